//! The CUDA C sources of the `cuda` backend (`kernels/cuda/*.cu`), as one NVRTC program, and
//! the launch constants the host and the kernels share. Nothing here needs CUDA: the program
//! text is plain data, so it is always built, and compiled to PTX wherever NVRTC can be loaded
//! (the test suite does so on machines without a GPU; see `kernels/tests/cuda_compile.rs`).

/// Threads of one attention block (four warps).
pub const ATT_THREADS: u32 = 128;
/// Cached positions staged in shared memory at a time (one per lane).
pub const ATT_CHUNK: usize = 32;
/// (token, query head) rows one attention block computes.
pub const ATT_MAX_ROWS: usize = 16;
/// The largest head dimension the attention kernel takes.
pub const ATT_MAX_HD: usize = 128;
/// Threads of a top-p sampling block.
pub const SAMPLE_THREADS: u32 = 1024;

/// The source files, in the order they are joined.
pub const SOURCES: [(&str, &str); 5] = [
    ("common.cuh", include_str!("../cuda/common.cuh")),
    ("dequant.cu", include_str!("../cuda/dequant.cu")),
    ("layers.cu", include_str!("../cuda/layers.cu")),
    ("attention.cu", include_str!("../cuda/attention.cu")),
    ("sampling.cu", include_str!("../cuda/sampling.cu")),
];

/// Every kernel the program defines (each is looked up by name after loading).
pub const KERNELS: [&str; 12] = [
    "dequant_q4_0",
    "dequant_q4_1",
    "dequant_q8_0",
    "f32_to_f16",
    "embed_rows",
    "rms_norm_rows",
    "rope_qk",
    "kv_write",
    "silu_mul",
    "paged_attention",
    "attention_combine",
    "argmax_rows",
];

/// The top-p kernel (listed apart: [`KERNELS`] plus this one are all of them).
pub const SAMPLE_TOP_P: &str = "sample_top_p";

/// The whole program: the shared constants as `#define`s, then every source file behind a
/// `#line` directive, so NVRTC's messages name the file and line they come from.
pub fn program() -> String {
    let mut s = format!(
        "#define ATT_THREADS {ATT_THREADS}\n#define ATT_WARPS {}\n#define ATT_CHUNK {ATT_CHUNK}\n\
         #define ATT_MAX_ROWS {ATT_MAX_ROWS}\n#define ATT_MAX_HD {ATT_MAX_HD}\n\
         #define SAMPLE_THREADS {SAMPLE_THREADS}\n",
        ATT_THREADS / 32
    );
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// Dynamic shared memory of one attention block, in bytes (the layout `attention.cu` carves).
pub fn attention_smem_bytes() -> u32 {
    let floats = 2 * ATT_MAX_ROWS * ATT_MAX_HD + 2 * ATT_MAX_ROWS;
    let words = ATT_CHUNK * (ATT_MAX_HD / 2 + 1) + ATT_CHUNK * ATT_MAX_HD / 2;
    (4 * (floats + words)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_once_and_named() {
        let p = program();
        for k in KERNELS.iter().chain(std::iter::once(&SAMPLE_TOP_P)) {
            let defs = p.matches(&format!(" {k}(")).count();
            assert_eq!(defs, 1, "{k} is defined {defs} times");
        }
        let defined = p.matches("extern \"C\" __global__").count();
        assert_eq!(
            defined,
            KERNELS.len() + 1,
            "a kernel is missing from KERNELS"
        );
    }

    #[test]
    fn attention_shared_memory_fits_the_default_limit() {
        // Above 48 KiB a launch needs an opt-in attribute per function.
        assert!(
            attention_smem_bytes() <= 48 * 1024,
            "{}",
            attention_smem_bytes()
        );
        assert_eq!(ATT_THREADS % 32, 0);
        assert_eq!(ATT_CHUNK, 32, "one cached position per lane");
    }
}
