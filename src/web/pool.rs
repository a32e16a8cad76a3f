//! The threads build's thread pool: rayon's threads running in Web Workers that share this
//! module's memory.
//!
//! The page, not the inference worker, starts those Web Workers (see `www/pool.js`): Firefox
//! (153 ESR) sometimes blocks a worker for good inside `new Worker()` when the worker itself
//! creates the pool's workers (nested workers; about one load in thirty on a 2-core host), which
//! left the page on "Loading…". The steps:
//! 1. the inference worker instantiates the module and asks the page for `n` pool workers,
//!    passing [`pool_module`] and [`pool_memory`];
//! 2. each pool worker instantiates the same module on the same memory, reports ready and calls
//!    [`pool_thread`], which waits for the rayon thread it will run;
//! 3. once all are ready, the inference worker calls [`build_pool`]: rayon hands one thread to
//!    each waiting worker.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Mutex, OnceLock};

use rayon::ThreadBuilder;
use wasm_bindgen::prelude::*;

/// Most threads a pool may have (`www/wasm.js` asks for no more): each is a Web Worker with its
/// own stack in the module's memory.
pub const MAX_POOL_THREADS: usize = 64;

/// Rayon's threads on their way from `build_pool` to the workers waiting in `pool_thread`.
struct Handoff {
    send: Mutex<SyncSender<ThreadBuilder>>,
    receive: Mutex<Receiver<ThreadBuilder>>,
}

fn handoff() -> &'static Handoff {
    static HANDOFF: OnceLock<Handoff> = OnceLock::new();
    HANDOFF.get_or_init(|| {
        let (send, receive) = sync_channel(MAX_POOL_THREADS);
        Handoff { send: Mutex::new(send), receive: Mutex::new(receive) }
    })
}

/// This module, for the pool's workers to instantiate.
#[wasm_bindgen(js_name = poolModule)]
pub fn pool_module() -> JsValue {
    wasm_bindgen::module()
}

/// This module's (shared) memory, for the pool's workers to instantiate the module on.
#[wasm_bindgen(js_name = poolMemory)]
pub fn pool_memory() -> JsValue {
    wasm_bindgen::memory()
}

/// In a pool worker: wait for the rayon thread [`build_pool`] hands over and run it (for good).
#[wasm_bindgen(js_name = poolThread)]
pub fn pool_thread() {
    let thread = {
        let receive = handoff().receive.lock().unwrap_or_else(|e| e.into_inner());
        receive.recv()
    };
    if let Ok(thread) = thread {
        thread.run();
    }
}

/// In the inference worker, once `n` pool workers wait in [`pool_thread`]: make rayon's global
/// pool of them and return its size. Call once.
#[wasm_bindgen(js_name = buildPool)]
pub fn build_pool(n: usize) -> Result<usize, JsError> {
    if !(1..=MAX_POOL_THREADS).contains(&n) {
        return Err(JsError::new(&format!("a pool of {n} threads (1 to {MAX_POOL_THREADS})")));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .spawn_handler(|thread| {
            let send = handoff().send.lock().unwrap_or_else(|e| e.into_inner());
            send.send(thread).map_err(|e| std::io::Error::other(e.to_string()))
        })
        .build_global()
        .map_err(|e| JsError::new(&format!("the thread pool did not start: {e}")))?;
    crate::cpu::BROWSER_THREADS.store(n, std::sync::atomic::Ordering::Relaxed);
    Ok(n)
}
