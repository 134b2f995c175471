//! Handing a call to the cpu backend's worker pool without allocating.
//!
//! A rayon parallel loop started from outside a pool pushes one job on rayon's global injector
//! (a crossbeam `Injector`), which allocates a new block every 63 pushes: a model calling
//! `forward` from its own thread would allocate about once every 63 calls. Instead the backend
//! keeps its own rayon pool with one long-lived dispatcher job in it, spawned once; a call hands
//! the dispatcher a pointer to its closure through a mutex and a condition variable (neither
//! allocates) and waits. The dispatcher runs the closure from inside the pool, where rayon's joins
//! go through the workers' own deques, which stop growing once warm.

use std::sync::{Condvar, Mutex, OnceLock};

/// A borrowed closure with its lifetime erased; valid until the caller sees `finished` move.
#[derive(Clone, Copy)]
struct JobRef(*mut (dyn FnMut() + Send + 'static));

// SAFETY: the pointee is `Send`, and the caller keeps it alive and untouched until the dispatcher
// has finished with it (`run` waits for that before returning).
unsafe impl Send for JobRef {}

#[derive(Default)]
struct State {
    job: Option<JobRef>,
    submitted: u64,
    finished: u64,
    panicked: bool,
}

struct Shared {
    pool: rayon::ThreadPool,
    /// Serialises callers: the pool runs one call at a time (it is saturated by one anyway).
    caller: Mutex<()>,
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<&'static Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("attnkit-cpu-{i}"))
            .build()
            .expect("cannot start the cpu backend's threads");
        let sh: &'static Shared = Box::leak(Box::new(Shared {
            pool,
            caller: Mutex::new(()),
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
        }));
        sh.pool.spawn(move || dispatcher(sh));
        sh
    })
}

fn dispatcher(sh: &'static Shared) {
    loop {
        let job = {
            let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = st.job.take() {
                    break j;
                }
                st = sh.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `run` published this pointer and waits, holding the closure alive and
            // unaliased, until `finished` moves past its ticket below.
            unsafe { (*job.0)() }
        }));
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        st.finished += 1;
        st.panicked = r.is_err();
        sh.done.notify_all();
    }
}

/// Run `f` on the cpu backend's pool (its rayon loops use that pool's workers) and wait for it.
/// Allocates nothing once the pool has started.
pub(crate) fn run<F: FnMut() + Send>(mut f: F) {
    let sh = shared();
    if sh.pool.current_thread_index().is_some() {
        return f(); // already on the pool (a nested call): run in place
    }
    let _one_at_a_time = sh.caller.lock().unwrap_or_else(|e| e.into_inner());
    let short: *mut (dyn FnMut() + Send + '_) = &mut f;
    // SAFETY: only the lifetime is erased; this function does not return before the dispatcher
    // has finished calling the closure (the wait below), so the borrow of `f` outlives every use.
    let job = JobRef(unsafe {
        std::mem::transmute::<*mut (dyn FnMut() + Send + '_), *mut (dyn FnMut() + Send + 'static)>(short)
    });
    let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
    st.job = Some(job);
    st.submitted += 1;
    let ticket = st.submitted;
    sh.work.notify_one();
    while st.finished < ticket {
        st = sh.done.wait(st).unwrap_or_else(|e| e.into_inner());
    }
    if st.panicked {
        drop(st);
        panic!("the cpu attention kernel panicked on a worker thread");
    }
}
