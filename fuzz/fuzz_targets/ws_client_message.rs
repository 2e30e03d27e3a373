//! Any text frame either parses, and then survives a round trip unchanged, or is
//! refused with a recoverable error; the parser never panics.
#![no_main]

use agentstack_protocol::ws::ClientMessage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match ClientMessage::parse(text) {
        Ok(message) => {
            let again = message.to_json();
            assert_eq!(ClientMessage::parse(&again).expect("own output parses"), message);
        }
        Err(err) => assert!(!err.code.is_fatal()),
    }
    let _ = agentstack_protocol::http::ResetRequest::parse(text);
});
