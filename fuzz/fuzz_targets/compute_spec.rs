//! Any text is either refused with an error or read into a job group that survives a
//! round trip: written back as YAML, it reads to the same group; the reader never panics.
#![no_main]

use agentstack_compute::JobGroup;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(group) = JobGroup::parse(text) {
        let yaml = group.to_yaml();
        let again = JobGroup::parse(&yaml)
            .unwrap_or_else(|e| panic!("own output does not parse: {e}\n{yaml}"));
        assert_eq!(again, group, "{yaml}");
    }
});
