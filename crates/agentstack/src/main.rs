//! The `agentstack` binary: everything lives in `agentstack-cli`.

/// mimalloc keeps freed memory for reuse. With glibc's allocator every forward pass's
/// large buffers (activations, quantized rows, outputs) went back to the OS and were
/// faulted in again, zeroed, one page at a time, on the calling thread: a third of a
/// 1B model's prefill at 1 thread was outside the kernels, most of it that (2 threads:
/// ~230 tok/s with glibc, ~320 with its buffers kept). Built without its transparent
/// huge page advice (`no_thp`): on a VM whose host takes back free memory, first
/// touches of huge pages made loads slow and erratic (1B Q6_K: 0.8-2.8 s, against
/// 0.87 s with it off); the weights still ask for huge pages themselves.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    agentstack_cli::main()
}
