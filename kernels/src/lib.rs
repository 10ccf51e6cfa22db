//! CUDA kernels for the replica's `cuda` backend, compiled at run time through cudarc's NVRTC
//! and checked against the CPU reference. Every `unsafe` block here carries a `// SAFETY:` line.
//!
//! Not built yet: the `sim` backend comes first; this crate stays empty until the `cuda`
//! backend lands so that nothing pretends to run on a GPU.
