//! Empty: cargo reads `[build-dependencies]` only for a package with a build script, and
//! this package's build dependencies unify the proc macros' features (Cargo.toml says why).
fn main() {}
