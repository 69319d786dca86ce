//! No code: a package whose only job is its Cargo.toml, which asks for one set of features
//! for the dependencies the library and the CLI share (that file says why).
#![forbid(unsafe_code)]
