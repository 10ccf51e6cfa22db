//! Every CUDA kernel compiles: the whole program goes through NVRTC for each GPU generation the
//! `cuda` backend targets, on any machine (NVRTC needs no GPU; `./scripts/test.sh` installs it
//! from PyPI's `nvidia-cuda-nvrtc` and sets `KVGATE_REQUIRE_NVRTC=1`, so a kernel that does not
//! compile fails CI). Without NVRTC and without that variable the test says so and passes.

#![cfg(feature = "gpu")]

use kernels::cuda_program::{KERNELS, SAMPLE_TOP_P};
use kernels::gpu::{compile_program, nvrtc_present};

fn nvrtc_or_skip() -> bool {
    if nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var_os("KVGATE_REQUIRE_NVRTC").is_none(),
        "KVGATE_REQUIRE_NVRTC is set but libnvrtc.so.{} cannot be loaded (LD_LIBRARY_PATH={:?})",
        kernels::gpu::CUDA_MAJOR,
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
    );
    eprintln!("skipped: NVRTC is not installed (pip install nvidia-cuda-nvrtc)");
    false
}

#[test]
fn every_kernel_compiles_to_ptx_for_ampere_ada_and_hopper() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["sm_80", "sm_89", "sm_90"] {
        let ptx = compile_program(Some(arch)).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        assert!(
            text.contains(&format!(".target {arch}")),
            "{arch}: no target line"
        );
        for k in KERNELS.iter().chain(std::iter::once(&SAMPLE_TOP_P)) {
            assert!(
                text.contains(&format!(".entry {k}(")),
                "{arch}: kernel {k} missing from the PTX"
            );
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_reported_with_its_file_and_line() {
    if !nvrtc_or_skip() {
        return;
    }
    // The same path the program takes, with a broken source: NVRTC's log must reach the error.
    let broken = "#line 7 \"broken.cu\"\nextern \"C\" __global__ void k(float* x) { x[0] = y; }\n";
    let err = cudarc::nvrtc::compile_ptx(broken).unwrap_err();
    let log = format!("{err}");
    assert!(log.contains("broken.cu(7)"), "{log}");
}
