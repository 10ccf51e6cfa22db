//! The math of kvgate's engine. The CPU reference kernels live here in plain Rust (with AVX2
//! paths chosen at run time where they pay); the replica's model code calls them, and the CUDA
//! kernels that follow are checked against them.
//!
//! Determinism is a contract, not an accident: every output element is computed by the same
//! sequence of floating-point operations whatever else is in the batch and whichever SIMD path
//! runs. A token's key, value and logits therefore do not depend on which other sequences
//! shared its step, how its prompt was chunked, or whether its prefix came from the cache —
//! the property the replica's prefix-reuse and batch-invariance detectors check bit for bit.
//! Threads split work over output rows (never over a reduction), so the thread count does not
//! change results either.
//!
//! - [`quant`]: the GGML block formats (Q4_0, Q4_1, Q8_0), F16/BF16, dequantisation and the
//!   activation quantisation the quantised dot products use.
//! - [`dot`]: block dot products, scalar reference and AVX2.
//! - [`matrix`]: weight matrices and the threaded `x · Wᵀ`.
//! - [`ops`]: RMSNorm, RoPE, SwiGLU, softmax.
//! - [`attention`]: the paged KV cache and attention over a sequence's blocks.
//! - [`kv_store`] and [`fp8`]: the cache's element types, f16 and FP8 E4M3 with per-token scales.
//! - [`plan`]: a step laid out as flat arrays for a device (tiles, slots, packed block tables).
//! - [`cuda_program`]: the CUDA C sources (`kernels/cuda/`) as one NVRTC program.
//! - `gpu` (feature `cuda`): the device runtime — driver probe, NVRTC, kernel launches, cuBLAS.

pub mod attention;
pub mod cuda_program;
pub mod dot;
pub mod fp8;
pub mod kquant;
pub mod kv_store;
pub mod matrix;
pub mod ops;
pub mod plan;
pub mod quant;

pub use attention::{AttentionShape, PagedKvCache};
pub use kv_store::KvElement;
pub use matrix::{matmul, matmul_many, Activations, Matrix, MatrixError, Stored};
pub use plan::{SeqSlice, StepPlan};
pub use quant::Format;

#[cfg(feature = "gpu")]
pub mod gpu;
