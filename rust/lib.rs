use pyo3::prelude::*;

mod encode;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    encode::register(m)?;
    Ok(())
}
