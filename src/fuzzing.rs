//! Entry points for the cargo-fuzz targets (placeholder: being written).
