//! Free loopback ports, for servers that take a port number rather than binding port 0
//! themselves (llama-server, components of a launch). The port is free when returned;
//! another process may take it before the server binds it, which on a test machine is
//! rare enough.

use std::net::TcpListener;

/// A port on 127.0.0.1 that nothing listens on.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("binding a loopback port")
        .port()
}

/// A port `p` with `p + 1` free too (checked by binding both), for two replicas that
/// take consecutive ports.
pub fn free_port_pair() -> u16 {
    loop {
        let first = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
        let port = first.local_addr().expect("a bound port").port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_is_two_free_ports() {
        let port = free_port_pair();
        TcpListener::bind(("127.0.0.1", port)).unwrap();
        TcpListener::bind(("127.0.0.1", port + 1)).unwrap();
        TcpListener::bind(("127.0.0.1", free_port())).unwrap();
    }
}
