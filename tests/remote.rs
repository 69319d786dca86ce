//! `MEMSNAP_REMOTE`: every published snapshot is also copied by the `memsnap upload-agent`
//! helper, end to end on the fake CUDA driver (no GPU). The `s3_*` tests upload to a moto
//! S3 server on 127.0.0.1; they are #[ignore]d, and scripts/test.sh installs moto into
//! target/tmp/moto-venv and runs them (`cargo test --test remote -- --ignored s3_`). Needs `cargo build --workspace`
//! first (the tests preload target/<profile>/libmemsnap.so, which finds the `memsnap`
//! binary beside it).

mod common;

use common::{run_program, snapshot_files};
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
    let out = Command::new(common::memsnap_bin())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
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
    assert_eq!(
        memsnap(&["ranks", &copies]),
        memsnap(&["ranks", &run.dir.path().display().to_string()])
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
fn memsnap_run_refuses_an_object_store_url_it_cannot_reach() {
    let out = std::process::Command::new(common::memsnap_bin())
        .args(["run", "--remote", "gs://bucket/{rank}.pickle", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MEMSNAP_REMOTE"), "{stderr}");
    assert!(stderr.contains("gs:// uploads are not built"), "{stderr}");
}

/// A moto S3 server on 127.0.0.1 with the bucket `snaps`, from the venv scripts/test.sh
/// installs; stopped when dropped.
struct Moto {
    server: Option<Child>,
    venv: PathBuf,
    port: u16,
}

impl Moto {
    /// Fails when moto is not installed (these tests are #[ignore]d; scripts/test.sh
    /// installs moto and runs them).
    fn start() -> Moto {
        let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("moto-venv");
        assert!(
            venv.join("bin/moto_server").is_file(),
            "no moto_server in {} (scripts/test.sh installs moto[server] there)",
            venv.display()
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let server = Command::new(venv.join("bin/moto_server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let moto = Moto {
            server: Some(server),
            venv,
            port,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "moto_server did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        moto.python("c.create_bucket(Bucket='snaps')", &[]);
        moto
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// What a program needs to reach the server (and nothing beyond 127.0.0.1).
    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", "testing".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9".to_string()),
        ]
    }

    /// Runs `code` with `c`, a boto3 S3 client of the server, and `sys.argv[1:] == args`.
    fn python(&self, code: &str, args: &[&str]) {
        let script = format!(
            "import boto3, os, sys\nc = boto3.client('s3', endpoint_url='{}', aws_access_key_id='testing', aws_secret_access_key='testing', region_name='us-east-1')\n{code}\n",
            self.endpoint()
        );
        let out = Command::new(self.venv.join("bin/python"))
            .arg("-c")
            .arg(script)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The objects under `prefix`, downloaded into a fresh folder, by last key component.
    fn objects(&self, prefix: &str) -> BTreeMap<String, Vec<u8>> {
        let dest = tempfile::tempdir().unwrap();
        self.python(
            "for o in c.list_objects_v2(Bucket='snaps', Prefix=sys.argv[1]).get('Contents', []):\n    c.download_file('snaps', o['Key'], os.path.join(sys.argv[2], o['Key'].rsplit('/', 1)[-1]))",
            &[prefix, &dest.path().display().to_string()],
        );
        contents(dest.path())
    }

    fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.stop();
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

#[test]
#[ignore = "needs moto_server (S3); scripts/test.sh installs it and runs the s3_ tests"]
fn s3_step_oom_and_exit_snapshots_reach_their_keys_and_read_back_the_same() {
    let moto = Moto::start();
    let aws = moto.env();
    let run = run_program(
        "steps",
        &["6"],
        &with_env(
            &aws,
            &[
                ("MEMSNAP_EVERY", "2"),
                ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
                (
                    "MEMSNAP_REMOTE",
                    "s3://snaps/run/r{rank}/{reason}-{seq}.pickle",
                ),
                ("RANK", "3"),
            ],
        ),
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    assert!(local.len() >= 4, "{:?}", local.keys());
    assert_eq!(moto.objects("run/r3/"), local, "{}", run.stderr);
    assert_eq!(upload_lines(&run.stderr), 0, "{}", run.stderr);

    let cli_env = with_env(&aws, &[]);
    let local_dir = run.dir.path().display().to_string();
    assert_eq!(
        memsnap_with(&["ranks", "s3://snaps/run/r3/"], &cli_env),
        memsnap(&["ranks", &local_dir])
    );
    assert_eq!(
        memsnap_with(&["summary", "s3://snaps/run/r3/step-1.pickle"], &cli_env),
        memsnap(&["summary", &format!("{local_dir}/step-1.pickle")])
    );

    let run = run_program(
        "oom",
        &[],
        &with_env(
            &aws,
            &[
                ("FAKE_CUDA_CAPACITY", "64M"),
                ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
                ("MEMSNAP_REMOTE", "s3://snaps/oom/{reason}-{seq}.pickle"),
            ],
        ),
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    assert!(local.contains_key("oom-1.pickle"), "{:?}", local.keys());
    assert_eq!(moto.objects("oom/"), local, "{}", run.stderr);
}

#[test]
#[ignore = "needs moto_server (S3); scripts/test.sh installs it and runs the s3_ tests"]
fn s3_missing_bucket_is_one_line_and_a_stopped_server_leaves_the_program_and_files_alone() {
    let mut moto = Moto::start();
    let aws = moto.env();
    let run = run_program(
        "steps",
        &["6"],
        &with_env(
            &aws,
            &[
                ("MEMSNAP_EVERY", "2"),
                (
                    "MEMSNAP_REMOTE",
                    "s3://no-such-bucket/{reason}-{seq}.pickle",
                ),
            ],
        ),
        true,
    );
    run.assert_success();
    assert!(snapshot_files(run.dir.path()).len() >= 4);
    assert_eq!(upload_lines(&run.stderr), 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("NoSuchBucket") || run.stderr.contains("404"),
        "{}",
        run.stderr
    );

    moto.stop();
    let run = run_program(
        "steps",
        &["3"],
        &with_env(
            &aws,
            &[
                ("MEMSNAP_REMOTE", "s3://snaps/{reason}-{seq}.pickle"),
                ("MEMSNAP_REMOTE_WAIT", "1s"),
            ],
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
