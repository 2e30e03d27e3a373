//! The floor: an axum WebSocket server that answers every frame with a fixed
//! observation, with no protocol parsing, sessions or environment. Served in place of
//! `agentstack` (`--servers agentstack --agentstack-bin target/release/examples/floor_server`),
//! it measures what the transport alone costs per step on this machine.

use axum::Router;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::routing::get;

const REPLY: &str = r#"{"type":"observation","data":{"observation":{"echoed_message":"hello","message_length":5,"metadata":{}},"reward":0.5,"done":false}}"#;

async fn session(mut socket: WebSocket) {
    while let Some(Ok(message)) = socket.recv().await {
        match message {
            Message::Text(_) if socket.send(Message::Text(REPLY.into())).await.is_err() => break,
            Message::Close(_) => break,
            _ => {}
        }
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let app = Router::new()
        .route("/health", get(|| async { r#"{"status":"healthy"}"# }))
        .route(
            "/ws",
            get(|ws: WebSocketUpgrade| async { ws.on_upgrade(session) }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await
}
