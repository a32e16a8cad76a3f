//! Running the programs a model file or a request carries (a chat template, a grammar, a JSON
//! schema): each under limits that end it with an error (the template's step and data budget,
//! the grammar's size and depth: see `chat` and `constraint`), and natively on a stack of its
//! own, because their interpreters and compilers recurse and the caller's stack (a test's 2 MB
//! thread, a debug build's large frames) should not be what decides. In wasm there is one
//! thread; `build.sh` links the module with an 8 MB stack, for which the limits are set.

use crate::error::Result;

/// The stack such work gets natively: far more than the limits let it use.
#[cfg(not(target_arch = "wasm32"))]
const STACK_BYTES: usize = 64 << 20;

/// `f`, natively on a thread with a stack of [`STACK_BYTES`] (a panic in it goes on in the
/// caller); in wasm, here.
pub fn on_own_stack<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("nexttoken-untrusted".into())
                .stack_size(STACK_BYTES)
                .spawn_scoped(scope, f)
                .map_err(|e| {
                    crate::Error::Input(format!("cannot start a thread to run it on: {e}"))
                })?;
            Ok(thread.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })
    }
    #[cfg(target_arch = "wasm32")]
    Ok(f())
}
