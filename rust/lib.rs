use pyo3::prelude::*;

mod encode;
mod hash;
mod pool;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    hash::register(m)?;
    encode::register(m)?;
    pool::register(m)?;
    Ok(())
}
