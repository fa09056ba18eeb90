//! Azurite, Microsoft's Azure Storage emulator (npm `azurite`), started by the tests on 127.0.0.1: Azure Blob
//! Storage as nightshift reaches it, through object_store's emulator settings and the account's shared key.

use std::process::{Child, Command, Stdio};

/// The emulator's one account and its published key (Azurite's documentation; not a secret).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Where the tests find Azurite: `NIGHTSHIFT_AZURITE`, the path of its `azurite-blob` (scripts/test.sh installs it
/// with npm), or `None` where it could not ([`super::installed`]).
pub fn azurite_binary() -> Option<String> {
    super::installed("NIGHTSHIFT_AZURITE", "Azurite (npm)")
}

/// An Azurite blob service on 127.0.0.1 holding its data in `dir`, stopped when dropped.
pub struct Azurite {
    child: Child,
    pub port: u16,
}

impl Azurite {
    /// Starts it, or `None` where the tests are told to skip Azure ([`azurite_binary`]).
    pub fn start(dir: &std::path::Path) -> Option<Azurite> {
        let binary = azurite_binary()?;
        let port = super::free_port();
        let location = dir.join("azurite");
        std::fs::create_dir_all(&location).unwrap();
        let child = Command::new(&binary)
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string(), "--location", location.to_str().unwrap(), "--silent", "--skipApiVersionCheck"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start Azurite ({binary}): {e}"));
        let mut azurite = Azurite { child, port };
        super::wait_until_listening(&mut azurite.child, port, "Azurite");
        Some(azurite)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates a container with a Create Container request signed with the account's shared key (Python's standard
    /// library does the HMAC; object_store has no call for it).
    pub fn create_container(&self, container: &str) {
        const CREATE: &str = r#"
import base64, email.utils, hashlib, hmac, http.client, sys
port, container, account, key = sys.argv[1], sys.argv[2], sys.argv[3], base64.b64decode(sys.argv[4])
date, version = email.utils.formatdate(usegmt=True), "2021-08-06"
path = f"/{account}/{container}"
to_sign = "\n".join(["PUT"] + [""] * 11 + [f"x-ms-date:{date}\nx-ms-version:{version}", f"/{account}{path}\nrestype:container"])
signature = base64.b64encode(hmac.new(key, to_sign.encode(), hashlib.sha256).digest()).decode()
connection = http.client.HTTPConnection("127.0.0.1", int(port))
headers = {"x-ms-date": date, "x-ms-version": version, "Authorization": f"SharedKey {account}:{signature}", "Content-Length": "0"}
connection.request("PUT", path + "?restype=container", headers=headers)
response = connection.getresponse()
body = response.read()
sys.exit(0 if response.status == 201 else f"Create Container: {response.status} {body[:300]!r}")
"#;
        let python = std::env::var("NIGHTSHIFT_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let status = Command::new(&python).args(["-c", CREATE, &self.port.to_string(), container, AZURITE_ACCOUNT, AZURITE_KEY]).status().unwrap();
        assert!(status.success(), "cannot create container {container} in Azurite");
    }

    /// What a job needs to reach it: object_store's emulator switch, the emulator's address and the account (whose
    /// key object_store knows for the emulator).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AZURE_STORAGE_USE_EMULATOR", "true".into()),
            ("AZURITE_BLOB_STORAGE_URL", self.endpoint()),
            ("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT.into()),
        ]
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
