//! The load-time check (`gpu::check`) catches a GPU that computes wrongly: here a kernel broken
//! on purpose (attention's merge scaled by 1.5, loaded through `NEXTTOKEN_SHADERS`, which is why
//! this test has a process of its own). Skipped loudly without a GPU adapter, unless
//! NEXTTOKEN_REQUIRE_GPU is set.

use nexttoken::gpu::{GpuContext, GpuModel, GpuOptions};
use nexttoken::model::{Arch, Model};
use nexttoken::synthetic::{self, Spec};

#[test]
fn load_check_names_the_adapter_of_a_miscomputing_gpu() {
    let merge = include_str!("../shaders/attention_merge.wgsl");
    let broken = merge.replace("= s / total;", "= 1.5 * s / total;");
    assert_ne!(broken, merge, "the merge's store was not found");
    let dir = std::env::temp_dir().join(format!("nexttoken-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("attention_merge.wgsl"), broken).unwrap();
    std::env::set_var("NEXTTOKEN_SHADERS", &dir);
    let ctx = match GpuContext::new() {
        Ok(ctx) => ctx,
        Err(e) if std::env::var_os("NEXTTOKEN_REQUIRE_GPU").is_none_or(|v| v == "0") => {
            eprintln!("\n*** SKIPPED: {e}; the GPU check test did not run ***\n");
            return;
        }
        Err(e) => panic!("NEXTTOKEN_REQUIRE_GPU is set but the GPU is unusable: {e}"),
    };
    let spec = Spec { n_head_kv: 2, ..Spec::new(Arch::Llama, 300, 96, 2, 4, 160, 64) };
    let model = Model::from_bytes(synthetic::write(&spec).unwrap()).unwrap();
    let gpu =
        pollster::block_on(GpuModel::with_options(ctx.clone(), model, GpuOptions::f32())).unwrap();
    let err = pollster::block_on(gpu.check_against_cpu()).unwrap_err().to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(err.contains(&ctx.describe()) && err.contains("computes wrong results"), "{err}");
}
