//! Any body either parses as a JSON-RPC request that round-trips, or yields an error
//! response; the parser never panics.
#![no_main]

use agentstack_protocol::mcp::JsonRpcRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match JsonRpcRequest::parse(text) {
        Ok(request) => {
            let again = serde_json::to_string(&request).expect("requests serialize");
            assert_eq!(JsonRpcRequest::parse(&again).expect("own output parses"), request);
        }
        Err(response) => assert!(response.outcome.is_err()),
    }
});
