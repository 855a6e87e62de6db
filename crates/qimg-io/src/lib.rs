//! Async storage backends (in progress).
