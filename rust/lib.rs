// Every unsafe operation sits in an `unsafe {}` block of its own, with a `// SAFETY:` comment
// saying why it holds; every `unsafe fn` says in `# Safety` what its caller must ensure
// (clippy.toml extends that lint to private functions).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

use pyo3::prelude::*;

mod cpython;
mod decode;
mod encode;
mod hash;
mod index;
pub mod native;
mod natsproto;
mod pool;
mod prefetch;
mod reader;
mod route;
mod scan;
mod view;
mod wake;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    hash::register(m)?;
    encode::register(m)?;
    scan::register(m)?;
    decode::register(m)?;
    wake::register(m)?;
    pool::register(m)?;
    index::register(m)?;
    natsproto::register(m)?;
    view::register(m)?;
    route::register(m)?;
    Ok(())
}
