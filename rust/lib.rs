use pyo3::prelude::*;

mod hash;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    hash::register(m)?;
    Ok(())
}
