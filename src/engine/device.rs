//! The device a job runs on, and what it has: which device `runtime.device` names, and its memory now.

use std::cell::OnceCell;

use candle_core::Device;

use super::ModelError;
use crate::job::DeviceChoice;

/// The device a job runs on. Without the `cuda` feature `auto` is the CPU and `cuda:N` an error. With it,
/// `cuda:N` must open, and `auto` is cuda:0 when it opens and otherwise the CPU: the job still runs, only slower,
/// and the log says which device was chosen and why.
pub fn select_device(choice: &DeviceChoice) -> Result<Device, ModelError> {
    #[cfg(not(feature = "cuda"))]
    match choice {
        DeviceChoice::Auto | DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda(n) => Err(ModelError::NoCuda(format!("cuda:{n}"))),
    }

    #[cfg(feature = "cuda")]
    {
        /// cudarc panics instead of returning an error in some cases (a driver library that is missing or lacks
        /// a symbol), so the panic is caught and becomes a [`ModelError::Cuda`]. The default hook still prints it.
        fn open_cuda(ordinal: usize) -> Result<Device, ModelError> {
            let error = |message: String| ModelError::Cuda { device: format!("cuda:{ordinal}"), message };
            match std::panic::catch_unwind(|| Device::new_cuda(ordinal)) {
                Ok(Ok(device)) => Ok(device),
                // candle appends a backtrace to its errors' text when RUST_BACKTRACE is set: the first line says it.
                Ok(Err(e)) => Err(error(e.to_string().lines().next().unwrap_or_default().to_string())),
                Err(panic) => {
                    let text = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
                    Err(error(format!("panicked: {}", text.as_deref().unwrap_or("(no message)"))))
                }
            }
        }

        match choice {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => open_cuda(*n),
            DeviceChoice::Auto => match open_cuda(0) {
                Ok(device) => {
                    tracing::info!(device = "cuda:0", "runtime.device = auto: running on cuda:0");
                    Ok(device)
                }
                Err(e) => {
                    tracing::info!(device = "cpu", reason = %e, "runtime.device = auto: running on the CPU");
                    Ok(Device::Cpu)
                }
            },
        }
    }
}

/// The KV cache budget in bytes: a size as given, or a fraction of the memory available now on the device the
/// cache lives on (host memory for the CPU, the GPU's free memory for CUDA; call it after the model has loaded,
/// so the weights are not counted twice).
pub fn kv_cache_bytes(budget: crate::job::MemoryBudget, device: &Device) -> u64 {
    budget.resolve(device_memory_available(device).unwrap_or(4 << 30))
}

/// A GPU's free and total memory now, from the driver; `None` for the CPU.
fn gpu_memory(device: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return cuda.cuda_stream().context().mem_get_info().ok().map(|(free, total)| (free as u64, total as u64));
    }
    let _ = device;
    None
}

/// A GPU's memory in use now (all processes); `None` for the CPU.
pub fn device_memory_in_use(device: &Device) -> Option<u64> {
    gpu_memory(device).map(|(free, total)| total - free)
}

/// Memory available now on a device: the GPU's free memory for CUDA, the host's for the CPU.
pub fn device_memory_available(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => crate::host::available_memory_bytes(),
        _ => gpu_memory(device).map(|(free, _)| free),
    }
}

/// `cpu` or `cuda:N`, as `runtime.device` names it.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

thread_local! {
    /// The CPU pool this thread works in, once [`join_cpu_pool`] made it; it lives as long as the thread.
    static CPU_POOL: OnceCell<Option<rayon::ThreadPool>> = const { OnceCell::new() };
}

/// Makes the calling thread worker 0 of a pool of its own, as large as the global one (`runtime.threads`), so the
/// engine's parallel operations (matrix products, attention) split between this thread and the pool's other
/// workers. Without it every operation is handed from this thread to the global pool's workers while this thread
/// sleeps and is woken again: two thread switches per operation, hundreds per decode step, measured at a fifth of
/// one sequence's decode time on 2 cores (`sched_yield` and futex wake-ups in the profile). Once per thread (rayon
/// leaves a thread in the pool it joined); a thread already in a pool (a rayon worker) stays in it.
pub fn join_cpu_pool() {
    CPU_POOL.with(|pool| {
        pool.get_or_init(|| {
            if rayon::current_thread_index().is_some() {
                return None;
            }
            let threads = rayon::current_num_threads();
            match rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .use_current_thread()
                .thread_name(|i| format!("nightshift-cpu-{i}"))
                .build()
            {
                Ok(pool) => Some(pool),
                Err(e) => {
                    tracing::warn!("cannot start the engine's CPU threads ({e}); the shared pool runs its operations");
                    None
                }
            }
        });
    });
}
