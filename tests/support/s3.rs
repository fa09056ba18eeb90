//! A moto S3 server the tests start on 127.0.0.1, and a TCP proxy in front of it that can take the store down, or
//! turn it into a store that throttles, answers slowly or lists stale.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;

/// A moto S3 server on 127.0.0.1, stopped when dropped.
pub struct Moto {
    child: Child,
    pub endpoint: String,
}

impl Moto {
    pub fn start() -> Moto {
        let port = super::free_port();
        let python = std::env::var("NIGHTSHIFT_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let child = Command::new(&python)
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start moto with {python}: {e} (scripts/test.sh installs moto[server])"));
        let mut moto = Moto { child, endpoint: format!("http://127.0.0.1:{port}") };
        super::wait_until_listening(&mut moto.child, port, "moto (is moto[server] installed? scripts/test.sh installs it)");
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

    /// Puts an object anyone may read (`x-amz-acl: public-read`), with a plain unsigned request as above: what a
    /// model served over plain HTTP is.
    pub fn put_public(&self, bucket: &str, key: &str, bytes: &[u8]) {
        use std::io::{Read, Write};
        let addr = self.endpoint.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        let head = format!("PUT /{bucket}/{key} HTTP/1.1\r\nHost: {addr}\r\nx-amz-acl: public-read\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", bytes.len());
        stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(bytes)).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "PutObject failed: {response}");
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
    fault: Arc<std::sync::atomic::AtomicU8>,
    state: Arc<FaultState>,
    /// Bytes passed from the server to clients (outside faults).
    down: Arc<std::sync::atomic::AtomicU64>,
}

/// A stream that counts the bytes written through it.
struct Counted {
    to: std::net::TcpStream,
    counter: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl std::io::Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.to.write(buf)?;
        if let Some(c) = &self.counter {
            c.fetch_add(n as u64, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.to.flush()
    }
}

/// How the proxy treats requests while it is up. Under a fault every request gets a connection of its own
/// (`Connection: close` both ways), so that each one meets the fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Bytes pass through.
    None = 0,
    /// Every other request is refused, as a store refuses a client that is too fast: `503 SlowDown` (S3) and
    /// `429 Too Many Requests` (GCS, Azure) in turn.
    Throttle = 1,
    /// Every response waits 300 ms before its first byte.
    Slow = 2,
    /// A listing (`list-type=2`) is answered as it was the first time it was asked, whatever was written since.
    StaleListing = 3,
}

/// Requests and responses under a fault: the stale listings kept, and a count for taking turns.
#[derive(Default)]
struct FaultState {
    listings: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
    requests: std::sync::atomic::AtomicUsize,
}

/// Reads an HTTP message's head (to the blank line) and its `Content-Length` body. `None` at end of stream.
fn read_message(stream: &mut std::net::TcpStream, until_eof: bool) -> Option<(String, Vec<u8>)> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let mut body = Vec::new();
    if until_eof {
        stream.read_to_end(&mut body).ok()?;
    } else {
        let length = head
            .lines()
            .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case("content-length")).map(|(_, v)| v.trim().parse::<usize>().unwrap_or(0)))
            .unwrap_or(0);
        body.resize(length, 0);
        stream.read_exact(&mut body).ok()?;
    }
    Some((head, body))
}

/// `head` with its `Connection` header replaced by `Connection: close`.
fn closing(head: &str) -> String {
    let mut lines: Vec<&str> = head.trim_end_matches("\r\n").split("\r\n").filter(|l| !l.to_ascii_lowercase().starts_with("connection:")).collect();
    lines.push("Connection: close");
    format!("{}\r\n\r\n", lines.join("\r\n"))
}

/// Serves one request of a client connection under `fault`.
fn serve_with_fault(mut client: std::net::TcpStream, upstream: u16, fault: Fault, state: &FaultState) {
    use std::io::Write;
    let Some((head, body)) = read_message(&mut client, false) else { return };
    let turn = state.requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    if fault == Fault::Throttle && turn.is_multiple_of(2) {
        let (status, text) = if turn.is_multiple_of(4) {
            ("503 Slow Down", "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>")
        } else {
            ("429 Too Many Requests", "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>TooManyRequests</Code><Message>Too many requests.</Message></Error>")
        };
        let _ = write!(client, "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}", text.len());
        return;
    }
    let request_line = head.lines().next().unwrap_or_default().to_string();
    let listing = fault == Fault::StaleListing && request_line.starts_with("GET ") && request_line.contains("list-type=2");
    if listing {
        if let Some(kept) = state.listings.lock().unwrap().get(&request_line) {
            let _ = client.write_all(kept);
            return;
        }
    }
    let Ok(mut server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else { return };
    if server.write_all(closing(&head).as_bytes()).and_then(|_| server.write_all(&body)).is_err() {
        return;
    }
    let Some((response_head, response_body)) = read_message(&mut server, true) else { return };
    let mut response = closing(&response_head).into_bytes();
    response.extend_from_slice(&response_body);
    if fault == Fault::Slow {
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    if listing {
        state.listings.lock().unwrap().entry(request_line).or_insert_with(|| response.clone());
    }
    let _ = client.write_all(&response);
}

impl Proxy {
    pub fn start(upstream: u16) -> Proxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let fault = Arc::new(std::sync::atomic::AtomicU8::new(Fault::None as u8));
        let (up2, stop2, fault2) = (up.clone(), stop.clone(), fault.clone());
        let state = Arc::new(FaultState::default());
        let state2 = state.clone();
        let down = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let down2 = down.clone();
        std::thread::spawn(move || {
            let state = state2;
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
                        let fault = match fault2.load(Ordering::SeqCst) {
                            1 => Fault::Throttle,
                            2 => Fault::Slow,
                            3 => Fault::StaleListing,
                            _ => Fault::None,
                        };
                        if fault != Fault::None {
                            open.lock().unwrap().push(client.try_clone().unwrap());
                            let state = state.clone();
                            std::thread::spawn(move || serve_with_fault(client, upstream, fault, &state));
                            continue;
                        }
                        let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else { continue };
                        let mut guard = open.lock().unwrap();
                        guard.push(client.try_clone().unwrap());
                        guard.push(server.try_clone().unwrap());
                        let pairs = [(client.try_clone().unwrap(), server.try_clone().unwrap(), None), (server, client, Some(down2.clone()))];
                        for (mut from, to, counter) in pairs {
                            std::thread::spawn(move || {
                                let mut counted = Counted { to, counter };
                                let _ = std::io::copy(&mut from, &mut counted);
                                let _ = counted.to.shutdown(std::net::Shutdown::Write);
                            });
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(std::time::Duration::from_millis(2)),
                    Err(_) => {}
                }
            }
        });
        Proxy { port, up, stop, fault, state, down }
    }

    pub fn set_up(&self, up: bool) {
        self.up.store(up, std::sync::atomic::Ordering::SeqCst);
    }

    /// Puts `fault` in force for the requests that follow. Connections already open are cut (as a blip in the
    /// store would), so that clients reconnect and meet it.
    /// Bytes the server sent to clients so far (outside faults).
    pub fn bytes_down(&self) -> u64 {
        self.down.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Requests served under a fault so far.
    pub fn requests_under_fault(&self) -> usize {
        self.state.requests.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Forgets the kept listings whose request names `prefix`: the next one is listed afresh (and kept).
    pub fn forget_listings(&self, prefix: &str) {
        self.state.listings.lock().unwrap().retain(|request, _| !request.contains(prefix));
    }

    pub fn set_fault(&self, fault: Fault) {
        self.fault.store(fault as u8, std::sync::atomic::Ordering::SeqCst);
        self.set_up(false);
        std::thread::sleep(std::time::Duration::from_millis(50));
        self.set_up(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Debian's `prometheus-pushgateway` on 127.0.0.1, stopped when dropped.
pub struct Pushgateway {
    child: Child,
    pub url: String,
}

impl Pushgateway {
    pub fn start() -> Pushgateway {
        let port = super::free_port();
        let child = Command::new("prometheus-pushgateway")
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus-pushgateway runs (scripts/test.sh installs it)");
        let mut gateway = Pushgateway { child, url: format!("http://127.0.0.1:{port}") };
        super::wait_until_listening(&mut gateway.child, port, "the Pushgateway");
        gateway
    }

    /// What it serves on `/metrics`.
    pub fn scrape(&self) -> String {
        use std::io::{Read, Write};
        let port = self.url.rsplit(':').next().unwrap();
        let mut stream = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
        // HTTP/1.0: the body comes whole, not chunked.
        write!(stream, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()
    }
}

impl Drop for Pushgateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Prometheus' text format parsed by the reference parser (the Python client's): (name, labels, value) per sample.
pub fn parse_prometheus(text: &str) -> Vec<(String, std::collections::BTreeMap<String, String>, f64)> {
    use std::io::Write;
    let script = "import sys, json\nfrom prometheus_client.parser import text_string_to_metric_families\n\
                  print(json.dumps([[s.name, s.labels, s.value] for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]))";
    let mut child = Command::new("python3").args(["-c", script]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the Prometheus parser refused:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}
