//! `MEMSNAP_REMOTE`: every published snapshot is also copied by the `memsnap upload-agent`
//! helper, end to end on the fake CUDA driver (no GPU). The emulator tests upload to a
//! local server on 127.0.0.1 and read back through the CLI: `s3_*` to moto (PyPI, in
//! target/tmp/moto-venv) and `azure_*` to Azurite (npm, in target/tmp/azurite; the Python
//! `azure-storage-blob` client, in target/tmp/azure-venv, creates its container and reads
//! objects back). They are #[ignore]d; scripts/test.sh installs the servers and runs them
//! (`cargo test --test remote -- --ignored`). The `gcs_*` tests need no server (see
//! there why none is used). Needs `cargo build --workspace` first (the
//! tests preload target/<profile>/libmemsnap.so, which finds the `memsnap` binary beside
//! it).

mod common;

use common::{run_program, snapshot_files, unsent_list};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// File name -> bytes of the regular files directly inside `dir`.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    snapshot_files(dir)
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn remote_url(dir: &Path) -> String {
    format!(
        "file://{}/r{{rank}}/{{reason}}-{{seq}}.pickle",
        dir.display()
    )
}

/// stdout of a successful `memsnap` command.
fn memsnap(args: &[&str]) -> String {
    memsnap_with(args, &[])
}

fn memsnap_with(args: &[&str], env: &[(&str, &str)]) -> String {
    String::from_utf8(stdout_of(
        Command::new(common::memsnap_bin())
            .args(args)
            .envs(env.iter().copied()),
    ))
    .unwrap()
}

/// stdout of `command`, which must succeed.
fn stdout_of(command: &mut Command) -> Vec<u8> {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn upload_lines(stderr: &str) -> usize {
    stderr.matches("could not upload").count()
}

#[test]
fn step_oom_and_exit_snapshots_are_uploaded_with_the_same_bytes() {
    let remote = tempfile::tempdir().unwrap();
    let url = remote_url(remote.path());
    let run = run_program(
        "steps",
        &["6"],
        &[
            ("MEMSNAP_EVERY", "2"),
            ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
            ("MEMSNAP_REMOTE", &url),
            ("RANK", "3"),
        ],
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    let names: Vec<&str> = local.keys().map(String::as_str).collect();
    assert!(names.contains(&"step-1.pickle"), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("exit-")), "{names:?}");
    assert_eq!(contents(&remote.path().join("r3")), local, "{}", run.stderr);
    assert_eq!(upload_lines(&run.stderr), 0, "{}", run.stderr);

    // The CLI reads the copies through their URLs: the same answers as the local files.
    let copies = format!("file://{}/r3/", remote.path().display());
    let local_dir = run.dir.path().display().to_string();
    // `ranks` names the files in its hint line: each by the place it was read from.
    assert_eq!(
        memsnap(&["ranks", &copies]).replace(&copies, "FOLDER/"),
        memsnap(&["ranks", &local_dir]).replace(&format!("{local_dir}/"), "FOLDER/")
    );
    let exit = names.iter().find(|n| n.starts_with("exit-")).unwrap();
    assert_eq!(
        memsnap(&["summary", &format!("{copies}{exit}")]),
        memsnap(&["summary", &run.dir.path().join(exit).display().to_string()])
    );

    let remote = tempfile::tempdir().unwrap();
    let url = remote_url(remote.path());
    let run = run_program(
        "oom",
        &[],
        &[
            ("FAKE_CUDA_CAPACITY", "64M"),
            ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
            ("MEMSNAP_REMOTE", &url),
            ("RANK", "0"),
        ],
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    assert!(local.contains_key("oom-1.pickle"), "{:?}", local.keys());
    assert!(local.contains_key("exit-2.pickle"), "{:?}", local.keys());
    assert_eq!(contents(&remote.path().join("r0")), local, "{}", run.stderr);
}

#[test]
fn remote_only_removes_the_local_file_after_the_copy() {
    let remote = tempfile::tempdir().unwrap();
    let url = remote_url(remote.path());
    let run = run_program(
        "steps",
        &["3"],
        &[
            ("MEMSNAP_REMOTE", &url),
            ("MEMSNAP_REMOTE_ONLY", "1"),
            ("RANK", "1"),
        ],
        true,
    );
    run.assert_success();
    let copies = contents(&remote.path().join("r1"));
    assert_eq!(copies.keys().collect::<Vec<_>>(), ["exit-1.pickle"]);
    assert!(copies["exit-1.pickle"].len() > 100);
    assert!(
        snapshot_files(run.dir.path()).is_empty(),
        "{:?}",
        snapshot_files(run.dir.path())
    );
    // The exit line names where the file is now, not the local path just removed.
    let line = run
        .stderr
        .lines()
        .find(|l| l.starts_with("memsnap: wrote"))
        .unwrap_or_else(|| panic!("no exit line: {}", run.stderr));
    let copy = format!("file://{}/r1/exit-1.pickle", remote.path().display());
    assert!(line.contains(&copy), "{line}");
    assert!(
        !line.contains(&run.dir.path().display().to_string()),
        "{line}"
    );
}

/// A file:// copy that cannot be written names its destination, not the local source.
#[test]
fn a_failed_file_copy_names_its_destination() {
    let run = run_program(
        "steps",
        &["1"],
        &[("MEMSNAP_REMOTE", "file:///proc/self/{reason}-{seq}.pickle")],
        true,
    );
    run.assert_success();
    let line = run
        .stderr
        .lines()
        .find(|l| l.contains("could not upload"))
        .unwrap_or_else(|| panic!("no failure line: {}", run.stderr));
    let reason = line.split(": ").skip(2).collect::<Vec<_>>().join(": ");
    assert!(
        reason.contains("writing /proc/self/exit-1.pickle"),
        "{line}"
    );
    assert!(!reason.contains("copying"), "{line}");
}

#[test]
fn a_failed_upload_is_one_line_and_keeps_the_local_files() {
    let run = run_program(
        "steps",
        &["6"],
        &[
            ("MEMSNAP_EVERY", "2"),
            (
                "MEMSNAP_REMOTE",
                "file:///proc/memsnap-cannot-write/{reason}-{seq}.pickle",
            ),
        ],
        true,
    );
    run.assert_success();
    let local = snapshot_files(run.dir.path());
    assert!(local.len() >= 4, "{local:?}");
    assert_eq!(upload_lines(&run.stderr), 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("the local file stays"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("uploads to MEMSNAP_REMOTE failed"),
        "{}",
        run.stderr
    );
}

#[test]
fn memsnap_run_refuses_a_url_form_it_does_not_accept() {
    let out = std::process::Command::new(common::memsnap_bin())
        .args(["run", "--remote", "abfs://c/{rank}.pickle", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MEMSNAP_REMOTE"), "{stderr}");
    assert!(stderr.contains("az://container/key"), "{stderr}");
}

/// A local object-store server for the emulator tests, holding the bucket (or container)
/// `snaps`; stopped when dropped.
trait Emulator {
    /// `scheme://snaps`, the root of the tests' URLs.
    fn root(&self) -> &'static str;
    /// What a program needs to reach the server (and nothing beyond 127.0.0.1).
    fn env(&self) -> Vec<(&'static str, String)>;
    /// The objects under `prefix` in `snaps`, by last key component.
    fn objects(&self, prefix: &str) -> BTreeMap<String, Vec<u8>>;
    fn server(&mut self) -> &mut Server;
}

/// A server process on a free port of 127.0.0.1; killed when dropped.
struct Server {
    child: Option<Child>,
    port: u16,
}

impl Server {
    /// Starts `program` with `args` (where `{port}` is the chosen port) and waits until it
    /// accepts connections.
    fn start(program: &Path, args: &[&str]) -> Server {
        assert!(
            program.is_file(),
            "no {} (scripts/test.sh installs the emulators)",
            program.display()
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()))
            .collect();
        let child = Command::new(program)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Server {
            child: Some(child),
            port,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{} did not start",
                program.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `code` in `venv`'s Python with `sys.argv[1:] == args`, after `prelude`.
fn python(venv: &Path, prelude: &str, code: &str, args: &[&str]) {
    stdout_of(
        Command::new(venv.join("bin/python"))
            .arg("-c")
            .arg(format!("import os, sys\n{prelude}\n{code}\n"))
            .args(args),
    );
}

/// The objects under `prefix`, written into a fresh folder by `download` (Python that gets
/// `sys.argv[1]`, the prefix, and `sys.argv[2]`, the folder), by last key component.
fn downloaded(
    venv: &Path,
    prelude: &str,
    download: &str,
    prefix: &str,
) -> BTreeMap<String, Vec<u8>> {
    let dest = tempfile::tempdir().unwrap();
    python(
        venv,
        prelude,
        download,
        &[prefix, &dest.path().display().to_string()],
    );
    contents(dest.path())
}

fn target_tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// moto, S3: the venv scripts/test.sh installs moto into.
struct Moto {
    server: Server,
    venv: PathBuf,
}

impl Moto {
    fn start() -> Moto {
        let venv = target_tmp("moto-venv");
        let server = Server::start(
            &venv.join("bin/moto_server"),
            &["-H", "127.0.0.1", "-p", "{port}"],
        );
        let moto = Moto { server, venv };
        python(
            &moto.venv,
            &moto.client(),
            "c.create_bucket(Bucket='snaps')",
            &[],
        );
        moto
    }

    /// Python making `c`, a boto3 S3 client of the server.
    fn client(&self) -> String {
        format!(
            "import boto3\nc = boto3.client('s3', endpoint_url='{}', aws_access_key_id='testing', aws_secret_access_key='testing', region_name='us-east-1')",
            self.server.endpoint()
        )
    }
}

impl Emulator for Moto {
    fn root(&self) -> &'static str {
        "s3://snaps"
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.server.endpoint()),
            ("AWS_ACCESS_KEY_ID", "testing".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9".to_string()),
        ]
    }

    fn objects(&self, prefix: &str) -> BTreeMap<String, Vec<u8>> {
        downloaded(
            &self.venv,
            &self.client(),
            "for o in c.list_objects_v2(Bucket='snaps', Prefix=sys.argv[1]).get('Contents', []):\n    c.download_file('snaps', o['Key'], os.path.join(sys.argv[2], o['Key'].rsplit('/', 1)[-1]))",
            prefix,
        )
    }

    fn server(&mut self) -> &mut Server {
        &mut self.server
    }
}

/// Azurite, Azure Blob Storage, with the container `snaps`, through the emulator's
/// well-known account (object_store: `AZURE_STORAGE_USE_EMULATOR`,
/// `AZURITE_BLOB_STORAGE_URL`).
struct Azurite {
    server: Server,
    venv: PathBuf,
    _data: tempfile::TempDir,
}

impl Azurite {
    fn start() -> Azurite {
        let data = tempfile::tempdir().unwrap();
        let server = Server::start(
            &target_tmp("azurite/node_modules/.bin/azurite-blob"),
            &[
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                "{port}",
                "--location",
                &data.path().display().to_string(),
                "--silent",
                // The Python client may speak a newer API version than the server knows.
                "--skipApiVersionCheck",
            ],
        );
        let azurite = Azurite {
            server,
            venv: target_tmp("azure-venv"),
            _data: data,
        };
        python(
            &azurite.venv,
            &azurite.client(),
            "c.create_container()",
            &[],
        );
        azurite
    }

    /// Python making `c`, a client of the container `snaps`, with the emulator's
    /// documented development account and key.
    fn client(&self) -> String {
        format!(
            "from azure.storage.blob import ContainerClient\nc = ContainerClient('{}/devstoreaccount1', 'snaps', credential={{'account_name': 'devstoreaccount1', 'account_key': '{AZURITE_KEY}'}})",
            self.server.endpoint()
        )
    }
}

/// Azurite's fixed development account key (published with the emulator).
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

impl Emulator for Azurite {
    fn root(&self) -> &'static str {
        "az://snaps"
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AZURE_STORAGE_USE_EMULATOR", "true".to_string()),
            ("AZURITE_BLOB_STORAGE_URL", self.server.endpoint()),
        ]
    }

    fn objects(&self, prefix: &str) -> BTreeMap<String, Vec<u8>> {
        downloaded(
            &self.venv,
            &self.client(),
            "for b in c.list_blobs(name_starts_with=sys.argv[1]):\n    open(os.path.join(sys.argv[2], b.name.rsplit('/', 1)[-1]), 'wb').write(c.download_blob(b.name).readall())",
            prefix,
        )
    }

    fn server(&mut self) -> &mut Server {
        &mut self.server
    }
}

fn with_env<'a>(
    owned: &'a [(&'static str, String)],
    more: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    owned
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .chain(more.iter().copied())
        .collect()
}

/// Step, OOM and exit snapshots reach `root/run/r3/...` and `root/oom/...` with the local
/// bytes, and `ranks` and `summary` over the URLs print what they print over the files.
fn snapshots_reach_their_keys_and_read_back_the_same(store: &dyn Emulator) {
    let root = store.root();
    let cloud = store.env();
    let template = format!("{root}/run/r{{rank}}/{{reason}}-{{seq}}.pickle");
    let run = run_program(
        "steps",
        &["6"],
        &with_env(
            &cloud,
            &[
                ("MEMSNAP_EVERY", "2"),
                ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
                ("MEMSNAP_REMOTE", &template),
                ("RANK", "3"),
            ],
        ),
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    assert!(local.len() >= 4, "{:?}", local.keys());
    assert_eq!(store.objects("run/r3/"), local, "{}", run.stderr);
    assert_eq!(upload_lines(&run.stderr), 0, "{}", run.stderr);

    let cli_env = with_env(&cloud, &[]);
    let local_dir = run.dir.path().display().to_string();
    let copies = format!("{root}/run/r3/");
    // `ranks` names the files in its hint line: each by the place it was read from.
    assert_eq!(
        memsnap_with(&["ranks", &copies], &cli_env).replace(&copies, "FOLDER/"),
        memsnap(&["ranks", &local_dir]).replace(&format!("{local_dir}/"), "FOLDER/")
    );
    assert_eq!(
        memsnap_with(
            &["summary", &format!("{root}/run/r3/step-1.pickle")],
            &cli_env
        ),
        memsnap(&["summary", &format!("{local_dir}/step-1.pickle")])
    );

    let template = format!("{root}/oom/{{reason}}-{{seq}}.pickle");
    let run = run_program(
        "oom",
        &[],
        &with_env(
            &cloud,
            &[
                ("FAKE_CUDA_CAPACITY", "64M"),
                ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
                ("MEMSNAP_REMOTE", &template),
            ],
        ),
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    assert!(local.contains_key("oom-1.pickle"), "{:?}", local.keys());
    assert_eq!(store.objects("oom/"), local, "{}", run.stderr);
}

/// Uploads refused with `refused` (credentials or bucket the server rejects) are one line
/// containing `says` and keep every local file.
fn a_refused_upload_is_one_line(refused: &[(&'static str, String)], remote: &str, says: &[&str]) {
    let run = run_program(
        "steps",
        &["6"],
        &with_env(
            refused,
            &[("MEMSNAP_EVERY", "2"), ("MEMSNAP_REMOTE", remote)],
        ),
        true,
    );
    run.assert_success();
    assert!(snapshot_files(run.dir.path()).len() >= 4);
    assert_eq!(upload_lines(&run.stderr), 1, "{}", run.stderr);
    assert!(
        says.iter().any(|s| run.stderr.contains(s)),
        "{}",
        run.stderr
    );
}

/// With the server stopped, the program ends on time (`MEMSNAP_REMOTE_WAIT`), its file is
/// kept, and one line names it.
fn a_stopped_server_leaves_the_program_and_files_alone(store: &mut dyn Emulator) {
    let cloud = store.env();
    let template = format!("{}/{{reason}}-{{seq}}.pickle", store.root());
    store.server().stop();
    an_unreachable_server_leaves_the_program_and_files_alone(&cloud, &template);
}

/// Uploads to `template` through `cloud`, whose server does not answer: see
/// [`a_stopped_server_leaves_the_program_and_files_alone`].
fn an_unreachable_server_leaves_the_program_and_files_alone(
    cloud: &[(&'static str, String)],
    template: &str,
) {
    let run = run_program(
        "steps",
        &["3"],
        &with_env(
            cloud,
            &[("MEMSNAP_REMOTE", template), ("MEMSNAP_REMOTE_WAIT", "1s")],
        ),
        true,
    );
    run.assert_success();
    let local = snapshot_files(run.dir.path());
    assert_eq!(local.len(), 1, "{local:?}");
    let unfinished: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("did not finish") || l.contains("could not upload"))
        .collect();
    assert_eq!(unfinished.len(), 1, "{}", run.stderr);
    assert!(
        unfinished[0].contains(&local[0].display().to_string()),
        "{}",
        run.stderr
    );
}

#[test]
#[ignore = "needs moto_server (S3); scripts/test.sh installs it and runs the emulator tests"]
fn s3_step_oom_and_exit_snapshots_reach_their_keys_and_read_back_the_same() {
    snapshots_reach_their_keys_and_read_back_the_same(&Moto::start());
}

#[test]
#[ignore = "needs moto_server (S3); scripts/test.sh installs it and runs the emulator tests"]
fn s3_missing_bucket_is_one_line_and_a_stopped_server_leaves_the_program_and_files_alone() {
    let mut moto = Moto::start();
    a_refused_upload_is_one_line(
        &moto.env(),
        "s3://no-such-bucket/{reason}-{seq}.pickle",
        &["NoSuchBucket", "404"],
    );
    a_stopped_server_leaves_the_program_and_files_alone(&mut moto);
}

/// A service-account file that sends object_store's GCS client to `base_url` without
/// OAuth (how it is pointed at a server other than Google's).
fn gcs_service_account(dir: &Path, base_url: &str) -> String {
    let path = dir.join("service-account.json");
    std::fs::write(
        &path,
        format!(
            r#"{{"gcs_base_url": "{base_url}", "disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": ""}}"#
        ),
    )
    .unwrap();
    path.display().to_string()
}

// No GCS emulator takes object_store's writes (it uses the XML API: fake-gcs-server answers
// its PUT with 400 "invalid uploadType", gcp-storage-emulator stores the object but sends no
// ETag and does not list), so gs:// is tested here without a server: credentials that
// cannot be used, and a server that does not answer.

#[test]
fn gcs_unusable_credentials_are_one_line_and_keep_the_local_files() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json").display().to_string();
    a_refused_upload_is_one_line(
        &[("GOOGLE_SERVICE_ACCOUNT", missing.clone())],
        "gs://snaps/{reason}-{seq}.pickle",
        &["missing.json"],
    );
    let out = Command::new(common::memsnap_bin())
        .args(["summary", "gs://snaps/run/exit-1.pickle"])
        .env("GOOGLE_SERVICE_ACCOUNT", &missing)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cannot read gs://snaps/run/exit-1.pickle")
            && stderr.contains("missing.json"),
        "{stderr}"
    );
}

#[test]
fn gcs_a_server_that_does_not_answer_leaves_the_program_and_files_alone() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on the discard port of 127.0.0.1.
    let account = gcs_service_account(dir.path(), "http://127.0.0.1:9");
    an_unreachable_server_leaves_the_program_and_files_alone(
        &[("GOOGLE_SERVICE_ACCOUNT", account)],
        "gs://snaps/{reason}-{seq}.pickle",
    );
}

#[test]
#[ignore = "needs Azurite (Azure Blob Storage); scripts/test.sh installs it and runs the emulator tests"]
fn azure_step_oom_and_exit_snapshots_reach_their_keys_and_read_back_the_same() {
    snapshots_reach_their_keys_and_read_back_the_same(&Azurite::start());
}

#[test]
#[ignore = "needs Azurite (Azure Blob Storage); scripts/test.sh installs it and runs the emulator tests"]
fn azure_missing_container_or_bad_key_is_one_line_and_a_stopped_server_leaves_the_program_and_files_alone()
 {
    let mut azurite = Azurite::start();
    a_refused_upload_is_one_line(
        &azurite.env(),
        "az://no-such-container/{reason}-{seq}.pickle",
        &["ContainerNotFound", "404"],
    );
    // A well-formed key that is not the account's: the server refuses the signature.
    let mut bad_key = azurite.env();
    bad_key.push((
        "AZURE_STORAGE_ACCOUNT_KEY",
        "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ==".to_string(),
    ));
    a_refused_upload_is_one_line(
        &bad_key,
        "az://snaps/{reason}-{seq}.pickle",
        &["403", "AuthorizationFailure", "Forbidden"],
    );
    a_stopped_server_leaves_the_program_and_files_alone(&mut azurite);
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|stat| {
                stat[stat.rfind(')').unwrap() + 1..]
                    .split_whitespace()
                    .nth(1)
                    == Some(&pid.to_string())
            })
        })
        .collect()
}

/// A field of /proc/PID/status (`SigBlk`, `State`, ...), trimmed.
fn status_field(pid: u32, key: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
}

/// `wait` with the preload and `env`, stderr into `stderr`; once it said it is ready.
fn spawn_wait_with(folder: &Path, env: &[(&str, String)], stderr: &Path) -> Child {
    use std::io::{BufRead, BufReader};
    let mut cmd = Command::new(common::program_path("wait"));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
            cmd.env_remove(key.as_ref());
        }
    }
    let mut child = cmd
        .env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env("LD_PRELOAD", common::preload_lib())
        .env("MEMSNAP_FOLDER", folder)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "result ready=1");
    std::thread::spawn(move || for _ in out.lines() {});
    child
}

/// Asks `pid` for a snapshot (through its socket) and returns the file.
fn dump(pid: u32) -> String {
    memsnap(&["dump", &pid.to_string()]).trim().to_string()
}

/// The upload helper of `pid`, once started.
fn upload_agent(pid: u32) -> u32 {
    let start = Instant::now();
    loop {
        if let Some(&agent) = children_of(pid).first() {
            return agent;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no upload helper"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill(pid: u32, signal: &str) {
    assert!(
        Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success()
    );
}

/// A server that accepts and never answers: every upload to it hangs. Its port.
fn silent_server() -> u16 {
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in server.incoming() {
            held.push(conn);
        }
    });
    port
}

/// The upload helper's list of what it could not send, for the program `pid` (beside
/// its snapshots in `dir`): its path and text.
fn unsent_of(dir: &Path, pid: u32) -> Option<(PathBuf, String)> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| unsent_list(p) == Some(pid))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
}

/// Waits until `pid` has ended (or is a zombie); false if it is still there after 10 s.
fn ended(pid: u32) -> bool {
    let start = Instant::now();
    while status_field(pid, "State").is_some_and(|s| !s.starts_with('Z')) {
        if start.elapsed() > Duration::from_secs(10) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The helper does not inherit the writer thread's all-blocked signal mask: SIGTERM stops
/// it, and it lists which files it was handed and did not upload.
#[test]
fn the_upload_helper_stops_on_sigterm_and_names_what_it_did_not_upload() {
    let port = silent_server();
    let dir = tempfile::tempdir().unwrap();
    let account = gcs_service_account(dir.path(), &format!("http://127.0.0.1:{port}"));
    let stderr = dir.path().join("stderr");
    let mut child = spawn_wait_with(
        dir.path(),
        &[
            (
                "MEMSNAP_REMOTE",
                "gs://snaps/{reason}-{seq}.pickle".to_string(),
            ),
            ("GOOGLE_SERVICE_ACCOUNT", account),
            ("MEMSNAP_REMOTE_WAIT", "1s".to_string()),
        ],
        &stderr,
    );
    let first = dump(child.id());
    let second = dump(child.id());
    let agent = upload_agent(child.id());
    assert_eq!(
        status_field(agent, "SigBlk").as_deref(),
        Some("0000000000000000"),
        "the helper starts with signals blocked"
    );
    // Both lines reached the helper before it is stopped.
    std::thread::sleep(Duration::from_millis(500));
    kill(agent, "TERM");
    assert!(ended(agent), "the helper ignored SIGTERM");
    let pid = child.id();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let said = std::fs::read_to_string(&stderr).unwrap();
    let (list, listed) = unsent_of(dir.path(), pid).unwrap_or_else(|| panic!("no list; {said}"));
    assert!(
        said.contains(&*list.to_string_lossy()),
        "the exit lines name the list: {said}"
    );
    for file in [&first, &second] {
        let line = listed
            .lines()
            .find(|l| l.starts_with(&format!("{file}\t")))
            .unwrap_or_else(|| panic!("{file} is not listed: {listed}"));
        assert!(line.ends_with("stopped by signal 15"), "{line}");
    }
}

/// The helper holds none of the program's descriptors: `prog 2>&1 | cat` ends with the
/// program while the helper still waits on a server that never answers, the exit line
/// names the list of files not sent, and a stop lists every one with its reason.
#[test]
fn the_upload_helper_lets_go_of_the_programs_output_and_lists_what_it_did_not_send() {
    let port = silent_server();
    let dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let account = gcs_service_account(keys.path(), &format!("http://127.0.0.1:{port}"));
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("\"$0\" 3 2>&1 | cat")
        .arg(common::program_path("steps"));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
            cmd.env_remove(key.as_ref());
        }
    }
    let mut pipeline = cmd
        .env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env(
            "FAKE_CUDART",
            common::fake_lib_dir().join("libcudart.so.13"),
        )
        .env("LD_PRELOAD", common::preload_lib())
        .env("MEMSNAP_FOLDER", dir.path())
        .env("MEMSNAP_REMOTE", "gs://snaps/{reason}-{seq}.pickle")
        .env("GOOGLE_SERVICE_ACCOUNT", &account)
        .env("MEMSNAP_REMOTE_WAIT", "1s")
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read on a thread: a pipeline held open by the helper would block here.
    let output = std::thread::spawn(move || {
        let mut out = String::new();
        use std::io::Read;
        pipeline
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        (pipeline.wait().unwrap(), out)
    });
    let start = Instant::now();
    while !output.is_finished() && start.elapsed() < Duration::from_secs(50) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let agent = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains("upload-agent") && c.contains(&*dir.path().to_string_lossy())
            })
        });
    assert!(
        output.is_finished(),
        "the pipeline did not end with the program (helper: {agent:?})"
    );
    let (status, out) = output.join().unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("result "), "the program's output: {out}");
    // The server never answers: a helper already gone means the pipeline waited for it.
    let agent = agent.expect("the pipeline ended only once the upload helper had given up");
    let local = snapshot_files(dir.path());
    assert_eq!(local.len(), 1, "{local:?}");
    let named = out
        .lines()
        .find(|l| l.contains("memsnap-unsent-"))
        .unwrap_or_else(|| panic!("the exit lines name no list: {out}"));
    kill(agent, "TERM");
    assert!(ended(agent), "the helper ignored SIGTERM");
    let list = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| unsent_list(p).is_some())
        .expect("the list of files not sent");
    assert!(named.contains(&*list.to_string_lossy()), "{named}");
    let listed = std::fs::read_to_string(&list).unwrap();
    let file = local[0].display().to_string();
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with(&format!("{file}\t")) && l.contains("signal 15")),
        "{listed}"
    );
}

/// `MEMSNAP_REMOTE_WAIT` (here its largest, 60 s) nests inside the library's exit wait: the
/// uploads are waited for, and the exit report (the exit line, the files that never left)
/// is printed after it. Takes a minute.
#[test]
fn the_longest_remote_wait_still_ends_with_the_exit_report() {
    let dir = tempfile::tempdir().unwrap();
    let remote = tempfile::tempdir().unwrap();
    let stderr = dir.path().join("stderr");
    let mut child = spawn_wait_with(
        dir.path(),
        &[
            ("MEMSNAP_REMOTE", remote_url(remote.path())),
            ("MEMSNAP_REMOTE_WAIT", "60s".to_string()),
        ],
        &stderr,
    );
    dump(child.id());
    let agent = upload_agent(child.id());
    // A helper that makes no progress: the exit snapshot's upload never finishes.
    kill(agent, "STOP");
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    kill(agent, "KILL");
    assert!(status.success());
    let said = std::fs::read_to_string(&stderr).unwrap();
    assert!(said.contains("did not finish within 60s"), "{said}");
    assert!(said.contains("memsnap: wrote 2 snapshots"), "{said}");
}
