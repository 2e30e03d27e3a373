//! Untrusted package bytes (as pulled from a registry) never panic the reader, and
//! whatever it accepts matches its manifest file for file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok((manifest, files)) = agentstack_hub::package::read_packed(bytes) {
        assert_eq!(manifest.files.len(), files.len());
        for entry in &manifest.files {
            let (contents, _) = &files[&entry.path];
            assert_eq!(entry.size, contents.len() as u64);
        }
    }
});
