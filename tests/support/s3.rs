//! A moto S3 server the tests start on 127.0.0.1, and a TCP proxy in front of it that can take the store down.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;

/// A moto S3 server on 127.0.0.1, stopped when dropped.
pub struct Moto {
    child: Child,
    pub endpoint: String,
}

impl Moto {
    pub fn start() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let python = std::env::var("NIGHTSHIFT_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let child = Command::new(&python)
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start moto with {python}: {e} (scripts/test.sh installs moto[server])"));
        let mut moto = Moto { child, endpoint: format!("http://127.0.0.1:{port}") };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = moto.child.try_wait() {
                panic!("moto exited with {status}: is moto[server] installed? (scripts/test.sh installs it)");
            }
            assert!(std::time::Instant::now() < deadline, "moto did not start within 60 s");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        moto
    }

    /// Creates a bucket with a plain (unsigned) S3 CreateBucket request, which moto accepts.
    pub fn create_bucket(&self, bucket: &str) {
        use std::io::{Read, Write};
        let addr = self.endpoint.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        write!(stream, "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "CreateBucket failed: {response}");
    }

    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy on 127.0.0.1 in front of another port, which can be taken down (connections refused, open ones
/// cut) and brought back on the same port: a store outage as clients see it, while the server behind keeps its
/// state (moto keeps objects only in memory, so stopping moto itself would lose them).
pub struct Proxy {
    pub port: u16,
    up: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub fn start(upstream: u16) -> Proxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let (up2, stop2) = (up.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut listener = Some(listener);
            let open: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>> = Default::default();
            while !stop2.load(Ordering::SeqCst) {
                if !up2.load(Ordering::SeqCst) {
                    listener = None;
                    for s in open.lock().unwrap().drain(..) {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    continue;
                }
                let l = listener.get_or_insert_with(|| std::net::TcpListener::bind(("127.0.0.1", port)).expect("the proxy port is free again"));
                l.set_nonblocking(true).unwrap();
                match l.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else { continue };
                        let mut guard = open.lock().unwrap();
                        guard.push(client.try_clone().unwrap());
                        guard.push(server.try_clone().unwrap());
                        for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)] {
                            std::thread::spawn(move || {
                                let _ = std::io::copy(&mut from, &mut to);
                                let _ = to.shutdown(std::net::Shutdown::Write);
                            });
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(std::time::Duration::from_millis(2)),
                    Err(_) => {}
                }
            }
        });
        Proxy { port, up, stop }
    }

    pub fn set_up(&self, up: bool) {
        self.up.store(up, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
