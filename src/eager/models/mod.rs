//! Models for the examples.
