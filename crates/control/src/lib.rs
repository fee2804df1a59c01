//! Control plane core (see ARCHITECTURE.md).
