//! Link settings for `libmemsnap.so`.
//!
//! rustc already exports only the `#[unsafe(no_mangle)] pub extern "C"` items of a cdylib
//! (the hooked CUDA symbols, `dlsym` and the `memsnap_*` C API) and hides everything else,
//! including the symbols of statically linked crates. What is added here:
//! - a soname, so `ldd`/`/proc/PID/maps` show `libmemsnap.so` whatever the file is called;
//! - `-z nodelete`: a library that hands out hook pointers must never be unloaded
//!   (tests and `memsnap.py` may `dlopen` it; a later `dlclose` would leave the host
//!   calling into unmapped code);
//! - `-z now`: resolve everything at load, so no lazy binding runs inside a hook.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmemsnap.so");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
    println!("cargo:rerun-if-changed=build.rs");
}
