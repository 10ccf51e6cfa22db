//! One typed method per kernel, and the f16 GEMM through cuBLAS. Each method checks the shapes
//! it can and launches on the GPU's stream; nothing waits.

use cudarc::cublas::sys as blas;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{DevPtr, Gpu, GpuError};
use crate::cuda_program::{attention_smem_bytes, ATT_MAX_HD, ATT_THREADS, SAMPLE_THREADS};

/// A kernel argument.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(DevPtr),
    I32(i32),
    I64(i64),
    F32(f32),
}

fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn int(n: usize) -> Arg {
    Arg::I32(i32::try_from(n).expect("shape exceeds i32"))
}

impl Gpu {
    /// Launches `name` with `args` (in the kernel's parameter order).
    pub fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), GpuError> {
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(self.func(name));
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: every kernel's parameters are listed in its wrapper below in order and with
        // their C types (pointers as 64-bit addresses); the buffers behind the addresses are
        // owned by the caller and sized for the shapes passed.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// GGML blocks (`Q4_0`, `Q4_1`, `Q8_0`) at `src` to `blocks × 32` f16 values at `dst`.
    pub fn dequant(
        &self,
        format: crate::Format,
        src: DevPtr,
        dst: DevPtr,
        blocks: usize,
    ) -> Result<(), GpuError> {
        let name = match format {
            crate::Format::Q4_0 => "dequant_q4_0",
            crate::Format::Q4_1 => "dequant_q4_1",
            crate::Format::Q8_0 => "dequant_q8_0",
            other => {
                return Err(GpuError::Unsupported(format!(
                    "no dequantisation kernel for {}",
                    other.name()
                )))
            }
        };
        self.launch(
            name,
            grid_1d(blocks, 256),
            &[Arg::Ptr(src), Arg::Ptr(dst), Arg::I64(blocks as i64)],
        )
    }

    /// `n` f32 values at `src` to f16 at `dst`.
    pub fn f32_to_f16(&self, src: DevPtr, dst: DevPtr, n: usize) -> Result<(), GpuError> {
        self.launch(
            "f32_to_f16",
            grid_1d(n, 256),
            &[Arg::Ptr(src), Arg::Ptr(dst), Arg::I64(n as i64)],
        )
    }

    /// `x[t] = table[ids[t]]` (f16 table, f32 rows) for `n` tokens.
    pub fn embed_rows(
        &self,
        table: DevPtr,
        ids: DevPtr,
        x: DevPtr,
        n: usize,
        hidden: usize,
    ) -> Result<(), GpuError> {
        self.launch(
            "embed_rows",
            per_row(n, 256),
            &[Arg::Ptr(table), Arg::Ptr(ids), Arg::Ptr(x), int(hidden)],
        )
    }

    /// `out[r] = rmsnorm(x[rows[r]]) · w` as f16, for `n` rows of `d` values.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_rows(
        &self,
        x: DevPtr,
        rows: DevPtr,
        w: DevPtr,
        out: DevPtr,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        self.launch(
            "rms_norm_rows",
            per_row(n, 256),
            &[
                Arg::Ptr(x),
                Arg::Ptr(rows),
                Arg::Ptr(w),
                Arg::Ptr(out),
                int(d),
                Arg::F32(eps),
            ],
        )
    }

    /// RoPE on the q and k heads of `n` rows of `qkv` (row stride `stride`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        qkv: DevPtr,
        pos: DevPtr,
        inv_freq: DevPtr,
        n: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        dims: usize,
        stride: usize,
    ) -> Result<(), GpuError> {
        self.launch(
            "rope_qk",
            per_row(n, 128),
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(pos),
                Arg::Ptr(inv_freq),
                int(heads),
                int(kv_heads),
                int(head_dim),
                int(dims),
                int(stride),
            ],
        )
    }

    /// Stores the keys and values of `n` rows of `qkv` in their cache slots.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        qkv: DevPtr,
        slots: DevPtr,
        k_cache: DevPtr,
        v_cache: DevPtr,
        n: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        stride: usize,
        k_off: usize,
        v_off: usize,
    ) -> Result<(), GpuError> {
        self.launch(
            "kv_write",
            per_row(n, 128),
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(slots),
                Arg::Ptr(k_cache),
                Arg::Ptr(v_cache),
                int(kv_heads),
                int(head_dim),
                int(block_size),
                int(stride),
                int(k_off),
                int(v_off),
            ],
        )
    }

    /// `act = silu(gate) · up` for `n` rows holding gate then up (`inter` values each).
    pub fn silu_mul(
        &self,
        gu: DevPtr,
        act: DevPtr,
        n: usize,
        inter: usize,
    ) -> Result<(), GpuError> {
        self.launch(
            "silu_mul",
            grid_1d(n * inter, 256),
            &[Arg::Ptr(gu), Arg::Ptr(act), int(inter), Arg::I64(n as i64)],
        )
    }

    /// Paged attention for a step's tiles, then the merge of its partitions when there are
    /// several. `out` receives `tokens × heads × head_dim` f16 values.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        a: &AttentionLaunch,
        qkv: DevPtr,
        k_cache: DevPtr,
        v_cache: DevPtr,
        tiles: DevPtr,
        table_off: DevPtr,
        tables: DevPtr,
        out: DevPtr,
        part_acc: DevPtr,
        part_ml: DevPtr,
    ) -> Result<(), GpuError> {
        if a.head_dim > ATT_MAX_HD || !a.head_dim.is_multiple_of(32) {
            return Err(GpuError::Unsupported(format!(
                "head dimension {}: the attention kernel takes multiples of 32 up to {ATT_MAX_HD}",
                a.head_dim
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (a.tiles as u32, a.kv_heads as u32, a.parts as u32),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: attention_smem_bytes(),
        };
        self.launch(
            "paged_attention",
            cfg,
            &[
                Arg::Ptr(qkv),
                int(a.stride),
                Arg::Ptr(k_cache),
                Arg::Ptr(v_cache),
                Arg::Ptr(tiles),
                Arg::Ptr(table_off),
                Arg::Ptr(tables),
                Arg::Ptr(out),
                Arg::Ptr(part_acc),
                Arg::Ptr(part_ml),
                int(a.tokens),
                int(a.heads),
                int(a.kv_heads),
                int(a.head_dim),
                int(a.block_size),
                int(a.part_len),
                Arg::F32(a.scale),
            ],
        )?;
        if a.parts > 1 {
            let cfg = LaunchConfig {
                grid_dim: (a.tokens as u32, a.heads as u32, 1),
                block_dim: (a.head_dim.min(128) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch(
                "attention_combine",
                cfg,
                &[
                    Arg::Ptr(part_acc),
                    Arg::Ptr(part_ml),
                    Arg::Ptr(out),
                    int(a.parts),
                    int(a.tokens),
                    int(a.heads),
                    int(a.head_dim),
                ],
            )?;
        }
        Ok(())
    }

    /// The greedy token of each of `rows` rows of `vocab` logits, into `out` (u32).
    pub fn argmax_rows(
        &self,
        logits: DevPtr,
        rows: usize,
        vocab: usize,
        out: DevPtr,
    ) -> Result<(), GpuError> {
        self.launch(
            "argmax_rows",
            per_row(rows, 256),
            &[Arg::Ptr(logits), int(vocab), Arg::Ptr(out)],
        )
    }

    /// Temperature and top-p sampling of `rows` rows; `params` holds (temperature, top_p,
    /// uniform draw) per row.
    pub fn sample_top_p(
        &self,
        logits: DevPtr,
        rows: usize,
        vocab: usize,
        params: DevPtr,
        out: DevPtr,
    ) -> Result<(), GpuError> {
        self.launch(
            crate::cuda_program::SAMPLE_TOP_P,
            per_row(rows, SAMPLE_THREADS),
            &[
                Arg::Ptr(logits),
                int(vocab),
                Arg::Ptr(params),
                Arg::Ptr(out),
            ],
        )
    }

    /// `c[n × out_f] = x[n × in_f] · wᵀ + beta · c`: `x` and `w` f16, row-major (`w` as
    /// `out_f` rows of `in_f`), `c` f32 with rows `ldc` apart; f32 accumulation.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_f16(
        &self,
        x: DevPtr,
        w: DevPtr,
        c: DevPtr,
        n: usize,
        out_f: usize,
        in_f: usize,
        ldc: usize,
        beta: f32,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let alpha = 1.0f32;
        // Column-major view: cᵀ (out_f × n) = w (read transposed from its in_f × out_f
        // column-major layout) · xᵀ (in_f × n).
        // SAFETY: the addresses hold buffers of the shapes named (the caller's contract); the
        // scalars live across the call, which only enqueues work on the handle's stream.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                out_f as i32,
                n as i32,
                in_f as i32,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                blas::cudaDataType::CUDA_R_16F,
                in_f as i32,
                x as *const std::ffi::c_void,
                blas::cudaDataType::CUDA_R_16F,
                in_f as i32,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                blas::cudaDataType::CUDA_R_32F,
                ldc as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }
}

/// The shape of one attention launch.
#[derive(Debug, Clone, Copy)]
pub struct AttentionLaunch {
    pub tiles: usize,
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Row stride of `qkv`, in floats.
    pub stride: usize,
    pub parts: usize,
    pub part_len: usize,
    pub scale: f32,
}
