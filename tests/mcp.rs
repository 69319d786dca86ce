//! `memsnap mcp` driven by a scripted client over its stdin and stdout (docs/MCP.md): the
//! handshake, the tool list and its input schemas, each tool on snapshots the demo program
//! wrote on the simulated driver (results equal to the CLI's `--json` output), and failures
//! (a missing file, a bad moment, an unknown tool) as tool errors after which the server
//! still answers.

mod common;

use common::{memsnap_bin, memsnap_json, run_program, snapshot_files};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A client speaking JSON-RPC 2.0, one message a line, to a `memsnap mcp` child.
struct Client {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    next_id: u64,
}

impl Client {
    fn start() -> Client {
        let mut child = Command::new(memsnap_bin())
            .arg("mcp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start memsnap mcp");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout: ChildStdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Client {
            child,
            stdin,
            lines,
            next_id: 1,
        }
    }

    fn send(&mut self, message: &Value) {
        self.send_line(&message.to_string());
    }

    fn send_line(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to memsnap mcp");
        self.stdin.flush().expect("flush");
    }

    /// The next message the server writes.
    fn next_message(&mut self) -> Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no message from the server: {e}"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON on stdout ({e}): {line}"))
    }

    /// Sends a request and returns its response (other messages in between are skipped).
    fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("no answer to {method} (id {id}): {e}"));
            let message: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not JSON on stdout ({e}): {line}"));
            assert_eq!(message["jsonrpc"], "2.0", "{line}");
            if message["id"] == json!(id) {
                return message;
            }
        }
    }

    /// `tools/call`: the call's result (a tool error is a result too).
    fn call(&mut self, tool: &str, arguments: Value) -> Value {
        let response = self.request("tools/call", json!({"name": tool, "arguments": arguments}));
        assert!(
            response.get("error").is_none(),
            "{tool}: a protocol error where a result was expected: {response}"
        );
        response["result"].clone()
    }

    fn initialize(&mut self) -> Value {
        let response = self.request(
            "initialize",
            json!({
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "tests/mcp.rs", "version": "0"}
            }),
        );
        self.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        response
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text_of(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text content: {result}"))
        .to_string()
}

/// The demo program's snapshots (every 2 steps and at exit): the run (it holds the folder),
/// the first step file and the exit file.
fn demo_snapshots() -> (common::Run, PathBuf, PathBuf) {
    let run = run_program("demo", &[], &[("MEMSNAP_EVERY", "2")], true);
    run.assert_success();
    let files = snapshot_files(run.dir.path());
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    let mut steps: Vec<PathBuf> = files
        .iter()
        .filter(|p| name(p).contains("-step"))
        .cloned()
        .collect();
    steps.sort();
    let exit = files
        .iter()
        .find(|p| name(p).contains("-exit-"))
        .cloned()
        .unwrap_or_else(|| panic!("no exit snapshot among {files:?}"));
    let first = steps.first().cloned().expect("a step snapshot");
    (run, first, exit)
}

#[test]
fn handshake_and_tool_list_with_schemas() {
    let mut c = Client::start();
    let init = c.initialize();
    let result = &init["result"];
    assert_eq!(result["serverInfo"]["name"], "memsnap", "{init}");
    assert!(result["capabilities"]["tools"].is_object(), "{init}");
    assert!(result["protocolVersion"].is_string(), "{init}");

    let list = c.request("tools/list", json!({}));
    let tools = list["result"]["tools"].as_array().expect("tools").clone();
    let mut names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        ["diff", "explain", "ranks", "summary", "whatif"],
        "{list}"
    );
    let required = |name: &str| -> Vec<String> {
        let tool = tools.iter().find(|t| t["name"] == name).unwrap();
        assert_eq!(tool["inputSchema"]["type"], "object", "{tool}");
        assert!(
            tool["description"]
                .as_str()
                .unwrap()
                .contains("JSON (--json)"),
            "{name}: the description carries the result's shape: {tool}"
        );
        let mut r: Vec<String> = tool["inputSchema"]["required"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        r.sort();
        r
    };
    assert_eq!(required("summary"), ["path"]);
    assert_eq!(required("diff"), ["after", "before"]);
    assert_eq!(required("ranks"), ["dir"]);
    assert_eq!(required("explain"), ["paths"]);
    assert_eq!(required("whatif"), ["path"]);
    let summary = tools.iter().find(|t| t["name"] == "summary").unwrap();
    for key in ["path", "at", "top", "ignore", "callers", "at_helpers"] {
        assert!(
            summary["inputSchema"]["properties"][key].is_object(),
            "summary has no `{key}` parameter: {summary}"
        );
    }
}

#[test]
fn each_tool_answers_what_the_cli_answers() {
    let (run, step, exit) = demo_snapshots();
    let (step, exit) = (step.to_str().unwrap(), exit.to_str().unwrap());
    let dir = run.dir.path().to_str().unwrap();
    let mut c = Client::start();
    c.initialize();

    let r = c.call("summary", json!({"path": exit}));
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&["summary", "--json", exit])
    );
    // The text content is the same JSON, for clients that read only text.
    let text: Value = serde_json::from_str(&text_of(&r)).expect("text is JSON");
    assert_eq!(text, r["structuredContent"]);

    let r = c.call(
        "summary",
        json!({"path": exit, "at": "end", "top": 3, "callers": 1, "ignore": ["nothing-matches"]}),
    );
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&[
            "summary",
            "--json",
            exit,
            "--at",
            "end",
            "--top",
            "3",
            "--callers",
            "1",
            "--ignore",
            "nothing-matches"
        ]),
        "{r}"
    );
    assert_eq!(r["structuredContent"]["devices"][0]["at"]["moment"], "end");

    let r = c.call("diff", json!({"before": step, "after": exit}));
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&["diff", "--json", step, exit])
    );
    assert!(
        r["structuredContent"]["total_growth_bytes"]
            .as_i64()
            .unwrap()
            > 0,
        "the demo leaks: {r}"
    );

    let r = c.call("diff", json!({"before": step, "after": exit, "at": "peak"}));
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&["diff", "--json", step, exit, "--at", "peak"])
    );

    let r = c.call("ranks", json!({"dir": dir}));
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&["ranks", "--json", dir])
    );

    let r = c.call("explain", json!({"paths": [exit], "at": "end"}));
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&["explain", "--json", exit, "--at", "end"])
    );

    // The demo has no PyTorch: whatif replays one of PyTorch's own snapshots.
    let oom = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torch/torch-oom.pickle"
    );
    let r = c.call(
        "whatif",
        json!({"path": oom, "set": ["expandable_segments:True"], "device_memory": "100GiB"}),
    );
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(
        r["structuredContent"],
        memsnap_json(&[
            "whatif",
            "--json",
            oom,
            "--set",
            "expandable_segments:True",
            "--device-memory",
            "100GiB"
        ])
    );
    assert_eq!(r["structuredContent"]["scenarios"][1]["fits"], true, "{r}");
}

#[test]
fn failures_are_tool_errors_and_the_server_goes_on() {
    let (_run, _, exit) = demo_snapshots();
    let exit = exit.to_str().unwrap();
    let mut c = Client::start();
    c.initialize();

    let missing = "/nonexistent/memsnap-mcp-test.pickle";
    let r = c.call("summary", json!({ "path": missing }));
    assert_eq!(r["isError"], true, "{r}");
    assert!(text_of(&r).contains(missing), "{r}");

    let r = c.call("summary", json!({"path": exit, "at": "sometime"}));
    assert_eq!(r["isError"], true, "{r}");
    assert!(text_of(&r).contains("sometime"), "{r}");

    let r = c.call("diff", json!({"before": exit, "after": missing}));
    assert_eq!(r["isError"], true, "{r}");

    let r = c.call("ranks", json!({"dir": "/nonexistent/memsnap-mcp-ranks"}));
    assert_eq!(r["isError"], true, "{r}");

    // A file without PyTorch's allocator: nothing to replay, said as a tool error.
    let r = c.call("whatif", json!({ "path": exit }));
    assert_eq!(r["isError"], true, "{r}");
    assert!(text_of(&r).contains("nothing to replay"), "{r}");

    // Not a tool at all: a JSON-RPC error, still no crash.
    let r = c.request("tools/call", json!({"name": "nope", "arguments": {}}));
    assert!(r.get("error").is_some(), "{r}");
    // Arguments that do not fit the input schema: Invalid params, naming the parameter.
    for (tool, arguments, says) in [
        (
            "summary",
            json!({"path": 12}),
            "summary: parameter `path` must be a string, not 12",
        ),
        (
            "summary",
            json!({"path": exit, "top": "ten"}),
            "summary: parameter `top` must be an integer >= 0 or null, not \"ten\"",
        ),
        (
            "summary",
            json!({"path": exit, "callers": -1}),
            "summary: parameter `callers` must be an integer >= 0 or null, not -1",
        ),
        (
            "explain",
            json!({"paths": exit}),
            "explain: parameter `paths` must be an array of strings, not",
        ),
        (
            "diff",
            json!({"before": exit, "after": exit, "ignore": [1]}),
            "diff: parameter `ignore` must be an array of strings, not [1]",
        ),
        (
            "diff",
            json!({"before": exit}),
            "diff: missing parameter `after`",
        ),
    ] {
        let r = c.request("tools/call", json!({"name": tool, "arguments": arguments}));
        assert_eq!(r["error"]["code"], -32602, "{r}");
        let message = r["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with(says), "{r}");
    }

    // A line that is not JSON: Parse error with id null (JSON-RPC 2.0, section 5.1).
    for line in [
        "this is not json",
        "{\"jsonrpc\": \"2.0\", \"id\": 9, \"method\":",
    ] {
        c.send_line(line);
        let r = c.next_message();
        assert_eq!(r["jsonrpc"], "2.0", "{r}");
        assert_eq!(r["id"], Value::Null, "{r}");
        assert!(r.as_object().unwrap().contains_key("id"), "{r}");
        assert_eq!(r["error"]["code"], -32700, "{r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Parse error"),
            "{r}"
        );
    }

    // And the server still works.
    let r = c.call("summary", json!({ "path": exit }));
    assert_eq!(r["isError"], false, "{r}");
}
