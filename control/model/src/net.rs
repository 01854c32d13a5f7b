//! Listeners for both planes (feature `tls`).

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// The queue of completed, not yet accepted connections the node, the control plane and
/// the example backends listen with (the kernel caps it at `net.core.somaxconn`).
pub const BACKLOG: u32 = 4096;

/// A listener whose queue of completed, not yet accepted connections holds `backlog`.
/// `TcpListener::bind` asks for 128, as the standard library does: a burst of new
/// connections (clients reconnecting after a deploy, a fleet of nodes after a control
/// plane restart, a gateway's pool opening 200 at once) overflows it, and the kernel
/// then drops handshakes whose clients retry only after a second.
pub fn listen(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_burst_of_connections_waits_in_the_queue_until_accepted() {
        let listener = listen("127.0.0.1:0".parse().unwrap(), BACKLOG).unwrap();
        let addr = listener.local_addr().unwrap();
        // 300 connections complete before the first accept: more than the 128 of
        // `TcpListener::bind`, whose overflow the kernel would answer by dropping them.
        let mut clients = Vec::new();
        for _ in 0..300 {
            let c = tokio::time::timeout(std::time::Duration::from_millis(500), tokio::net::TcpStream::connect(addr))
                .await
                .expect("a connection waited for a retransmission: the queue overflowed")
                .unwrap();
            clients.push(c);
        }
        for _ in 0..300 {
            listener.accept().await.unwrap();
        }
    }
}
