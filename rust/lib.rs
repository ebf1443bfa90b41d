use pyo3::prelude::*;

mod cpython;
mod encode;
mod hash;
mod index;
mod natsproto;
pub mod native;
mod pool;
mod scan;
mod view;
mod wake;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    hash::register(m)?;
    encode::register(m)?;
    scan::register(m)?;
    wake::register(m)?;
    pool::register(m)?;
    index::register(m)?;
    natsproto::register(m)?;
    view::register(m)?;
    Ok(())
}
