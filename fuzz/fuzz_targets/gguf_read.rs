//! Untrusted model and importance-matrix files (pulled from anywhere) never panic the
//! quantizer's readers, and every tensor the GGUF reader accepts reads back at its
//! declared size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("agentstack-fuzz-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).expect("temp dir is writable");
    if let Ok(mut file) = agentstack_quant::gguf::Gguf::open(&path) {
        for i in 0..file.tensors.len() {
            let want = file.tensors[i].bytes();
            assert!(want <= bytes.len() as u64);
            let data = file.read(i).expect("an accepted directory reads");
            assert_eq!(data.len() as u64, want);
        }
    }
    // The same bytes as an importance matrix (GGUF or legacy `.dat`, told by the magic).
    let _ = agentstack_quant::imatrix::Imatrix::load(&path);
});
