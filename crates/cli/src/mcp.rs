//! `memsnap mcp`: a Model Context Protocol server on stdin/stdout (docs/MCP.md), so that an
//! agent can ask what holds the memory in a snapshot without parsing text.
//!
//! Each tool is one reading command with `--json`: its arguments become the command's own
//! arguments (parsed by the command's clap definition, so `at` takes exactly what `--at`
//! takes), the command runs unchanged, and its JSON output is the tool's structured result.
//! A tool's result therefore equals `memsnap <command> --json` with the same arguments. A
//! command that fails (a missing file, an `at` no device reached) is a tool error result
//! with the command's message, never a protocol error or a crash. The protocol itself is
//! rmcp's (the official Rust SDK), with two JSON-RPC answers it does not give: a line that
//! is not JSON gets Parse error (-32700, id null; rmcp drops it without a word), and
//! arguments that do not fit a tool's input schema get Invalid params (-32602) naming the
//! parameter (rmcp makes them a tool result with serde's message, which names none). Cold
//! code.

use crate::{diff, explain, ranks, summary, whatif};
use clap::Parser;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    Implementation, JsonObject, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler, ServiceExt, schemars, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::Value;
use std::ffi::OsString;
use std::process::ExitCode;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[derive(clap::Args, Debug)]
pub struct Args {}

/// The reading commands a tool runs, parsed from the argument vector a tool call builds.
#[derive(Parser, Debug)]
#[command(name = "memsnap", no_binary_name = true)]
enum Reading {
    Summary(summary::Args),
    Diff(diff::Args),
    Ranks(ranks::Args),
    Explain(explain::Args),
    Whatif(whatif::Args),
}

/// How to choose the allocation site: the `--ignore`, `--callers` and `--at-helpers` of
/// every command.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct Attribution {
    /// Skip frames whose file or function contains one of these patterns when choosing the
    /// allocation site (`--ignore`, repeatable).
    #[serde(default)]
    pub ignore: Vec<String>,
    /// Show this many callers above each allocation site; sites are then grouped by the
    /// whole chain (`--callers`).
    pub callers: Option<u32>,
    /// Show a helper's allocations at its own line, not at the lines that call it
    /// (`--at-helpers`).
    #[serde(default)]
    pub at_helpers: bool,
}

/// `summary`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SummaryParams {
    /// The snapshot file: memsnap's or PyTorch's `_dump_snapshot` pickle (a path on the
    /// server's machine, or an object-store URL the CLI reads).
    pub path: String,
    /// The moment to show what was live at (`--at`): "peak", "oom", "end", an event number
    /// ("1234") or a time since the first recorded event ("250ms", "12.5s", "3m"). Default:
    /// the first OOM when the device has one, else the peak.
    pub at: Option<String>,
    /// How many allocation sites to list (`--top`, default 10).
    pub top: Option<u32>,
    #[serde(flatten)]
    pub attribution: Attribution,
}

/// `diff`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct DiffParams {
    /// The earlier snapshot.
    pub before: String,
    /// The later snapshot.
    pub after: String,
    /// Compare both files at this moment (`--at`; default "end"), as in `summary`.
    pub at: Option<String>,
    /// The moment of `before` only (`--at-before`; overrides `at` for it).
    pub at_before: Option<String>,
    /// The moment of `after` only (`--at-after`; overrides `at` for it).
    pub at_after: Option<String>,
    /// How many growing sites to list (`--top`, default 10; shrinking: a quarter of it).
    pub top: Option<u32>,
    #[serde(flatten)]
    pub attribution: Attribution,
}

/// `ranks`' arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RanksParams {
    /// A folder holding one snapshot per rank (*.pickle, *.pkl).
    pub dir: String,
    #[serde(flatten)]
    pub attribution: Attribution,
}

/// `explain`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ExplainParams {
    /// Snapshot files, folders of a run, or s3://, gs://, az:// prefixes.
    pub paths: Vec<String>,
    /// The moment owners and roles are told at (`--at`: peak, oom, end, an event number or
    /// a time); default: the OOM if any, else the peak.
    pub at: Option<String>,
    #[serde(flatten)]
    pub attribution: Attribution,
}

/// `whatif`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WhatifParams {
    /// The snapshot file (memsnap's, or PyTorch's own with its trace).
    pub path: String,
    /// Scenarios: the run as if PYTORCH_CUDA_ALLOC_CONF had been each of these
    /// (`--set`, one scenario each: "expandable_segments:True,max_split_size_mb:128" is one
    /// of two keys). Default, with neither `set` nor `scale`: expandable_segments:True,
    /// max_split_size_mb:128, backend:cudaMallocAsync.
    #[serde(default)]
    pub set: Vec<String>,
    /// Scenarios with larger requests of some roles (`--scale`): "activations=2,temporaries=2".
    #[serde(default)]
    pub scale: Vec<String>,
    /// The device's memory in place of the recorded capacity (`--device-memory`: "80GiB").
    pub device_memory: Option<String>,
    #[serde(flatten)]
    pub attribution: Attribution,
}

/// A tool's description: what it answers, then the JSON shape its command documents.
fn describe(what: &str, shape: &str) -> String {
    format!("{what}\n\nThe result is the JSON of the command's --json output:\n{shape}")
}

/// The server: one tool per reading command.
#[derive(Clone)]
pub struct Server {
    tool_router: ToolRouter<Self>,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            tool_router: Self::tool_router(),
        }
    }
}

#[tool_router]
impl Server {
    #[tool(
        name = "summary",
        description = describe(
            "What held GPU memory in one snapshot, per device: at the moment that matters \
             (the first OOM, else the peak, or `at`) beside the end: allocation sites, \
             libraries, OOMs, API calls. Same as `memsnap summary PATH --json`.",
            summary::JSON_SHAPE,
        )
    )]
    async fn summary(
        &self,
        Parameters(p): Parameters<SummaryParams>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut argv = args(["summary", "--json"]);
        argv.push(p.path.into());
        option(&mut argv, "--at", p.at);
        option(&mut argv, "--top", p.top);
        attribution(&mut argv, p.attribution);
        Ok(call(argv).await)
    }

    #[tool(
        name = "diff",
        description = describe(
            "What grew between two snapshots, by allocation site, at their ends or at the \
             moments `at`, `at_before`, `at_after` name. Same as `memsnap diff BEFORE AFTER \
             --json`.",
            diff::JSON_SHAPE,
        )
    )]
    async fn diff(
        &self,
        Parameters(p): Parameters<DiffParams>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut argv = args(["diff", "--json"]);
        argv.push(p.before.into());
        argv.push(p.after.into());
        option(&mut argv, "--at", p.at);
        option(&mut argv, "--at-before", p.at_before);
        option(&mut argv, "--at-after", p.at_after);
        option(&mut argv, "--top", p.top);
        attribution(&mut argv, p.attribution);
        Ok(call(argv).await)
    }

    #[tool(
        name = "ranks",
        description = describe(
            "One row per rank file in a folder (live, reserved and peak bytes, OOMs, the top \
             site) and the ranks that stand out. Same as `memsnap ranks DIR --json`.",
            ranks::JSON_SHAPE,
        )
    )]
    async fn ranks(
        &self,
        Parameters(p): Parameters<RanksParams>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut argv = args(["ranks", "--json"]);
        argv.push(p.dir.into());
        attribution(&mut argv, p.attribution);
        Ok(call(argv).await)
    }

    #[tool(
        name = "explain",
        description = describe(
            "The answers: why a job ran out of memory (the verdict: live, fragmentation or \
             outside, with the sites and owners), what leaks across steps, who owns every \
             byte, which rank is worst. `paths`: files, run folders or prefixes, as `ranks` \
             takes. Same as `memsnap explain PATH... --json`.",
            explain::JSON_SHAPE,
        )
    )]
    async fn explain(
        &self,
        Parameters(p): Parameters<ExplainParams>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut argv = args(["explain", "--json"]);
        argv.extend(p.paths.into_iter().map(OsString::from));
        option(&mut argv, "--at", p.at);
        attribution(&mut argv, p.attribution);
        Ok(call(argv).await)
    }

    #[tool(
        name = "whatif",
        description = describe(
            "Would it have fitted under other settings? The recorded run replayed through a \
             model of PyTorch's caching allocator: as recorded (checked against the \
             recording), under each `set` (PYTORCH_CUDA_ALLOC_CONF text), with larger \
             requests of some roles (`scale`): peak reserved and allocated bytes, \
             fragmentation at the peak, whether it fits and where it runs out; for an OOM \
             file, which settings avoid it. Same as `memsnap whatif PATH --json`.",
            whatif::JSON_SHAPE,
        )
    )]
    async fn whatif(
        &self,
        Parameters(p): Parameters<WhatifParams>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut argv = args(["whatif", "--json"]);
        argv.push(p.path.into());
        for s in p.set {
            argv.push("--set".into());
            argv.push(s.into());
        }
        for s in p.scale {
            argv.push("--scale".into());
            argv.push(s.into());
        }
        option(&mut argv, "--device-memory", p.device_memory);
        attribution(&mut argv, p.attribution);
        Ok(call(argv).await)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Server {
    /// The router's call, after the arguments are checked against the tool's input schema.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if let Some(tool) = self.tool_router.get(&request.name)
            && let Some(why) = misfit(&tool.input_schema, request.arguments.as_ref())
        {
            return Err(ErrorData::invalid_params(
                format!("{}: {why}", request.name),
                None,
            ));
        }
        let call = ToolCallContext::new(self, request, context);
        self.tool_router.call(call).await
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("memsnap", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Reads GPU memory snapshots (memsnap's and PyTorch's memory_viz pickles) and \
                 answers what holds the memory: `summary` for one file, `diff` for two, \
                 `ranks` for a folder of per-rank files, `explain` for the answers (why it \
                 ran out of memory, leaks, owners), `whatif` for what would have fitted under \
                 other allocator settings. Paths are on the server's machine. \
                 Each result is the JSON of the matching `memsnap <command> --json`.",
            )
    }
}

/// Why `arguments` do not fit a tool's input `schema`, naming the parameter; `None` when
/// they fit. Reads what the schemas generated from the argument types above hold: the
/// required names, and each property's type or types with an integer's minimum and an
/// array's item type. Parameters the schema does not list are left to serde (ignored).
fn misfit(schema: &JsonObject, arguments: Option<&JsonObject>) -> Option<String> {
    let empty = JsonObject::new();
    let arguments = arguments.unwrap_or(&empty);
    let required = schema.get("required").and_then(Value::as_array);
    if let Some(name) = required
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .find(|name| !arguments.contains_key(*name))
    {
        return Some(format!("missing parameter `{name}`"));
    }
    let properties = schema.get("properties").and_then(Value::as_object)?;
    arguments.iter().find_map(|(name, value)| {
        let expected = properties.get(name)?;
        (!fits(value, expected)).then(|| {
            format!(
                "parameter `{name}` must be {}, not {value}",
                describe_type(expected)
            )
        })
    })
}

/// The JSON types a property's schema allows.
fn types(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

fn fits(value: &Value, schema: &Value) -> bool {
    let allowed = types(schema);
    allowed.is_empty()
        || allowed.iter().any(|&t| match t {
            "string" => value.is_string(),
            "null" => value.is_null(),
            "boolean" => value.is_boolean(),
            "object" => value.is_object(),
            "number" => value.is_number(),
            "integer" => {
                let at_least_minimum = match schema.get("minimum").and_then(Value::as_i64) {
                    Some(min) => value.as_i64().is_none_or(|v| v >= min),
                    None => true,
                };
                let in_format = match schema.get("format").and_then(Value::as_str) {
                    Some("uint32") => value.as_u64().is_some_and(|v| v <= u32::MAX as u64),
                    _ => true,
                };
                (value.is_i64() || value.is_u64()) && at_least_minimum && in_format
            }
            "array" => value.as_array().is_some_and(|items| {
                let item = schema.get("items").unwrap_or(&Value::Null);
                items.iter().all(|v| fits(v, item))
            }),
            _ => true,
        })
}

/// `a string or null`, `an integer >= 0 or null`, `an array of strings`.
fn describe_type(schema: &Value) -> String {
    let one = |t: &str| match t {
        "integer" => match schema.get("minimum").and_then(Value::as_i64) {
            Some(min) => format!("an integer >= {min}"),
            None => "an integer".to_string(),
        },
        "array" => {
            let item = schema.get("items").unwrap_or(&Value::Null);
            let of: Vec<String> = types(item).iter().map(|t| format!("{t}s")).collect();
            match of.as_slice() {
                [] => "an array".to_string(),
                _ => format!("an array of {}", of.join(" or ")),
            }
        }
        "null" => "null".to_string(),
        "object" => "an object".to_string(),
        t => format!("a {t}"),
    };
    types(schema)
        .into_iter()
        .map(one)
        .collect::<Vec<_>>()
        .join(" or ")
}

fn args<const N: usize>(words: [&str; N]) -> Vec<OsString> {
    words.iter().map(OsString::from).collect()
}

fn option(argv: &mut Vec<OsString>, flag: &str, value: Option<impl ToString>) {
    if let Some(v) = value {
        argv.push(flag.into());
        argv.push(v.to_string().into());
    }
}

fn attribution(argv: &mut Vec<OsString>, a: Attribution) {
    for pattern in a.ignore {
        argv.push("--ignore".into());
        argv.push(pattern.into());
    }
    option(argv, "--callers", a.callers);
    if a.at_helpers {
        argv.push("--at-helpers".into());
    }
}

/// Runs one reading command with `argv` (on a blocking thread: commands read files and may
/// start their own runtime for object stores) and turns its output into a tool result.
async fn call(argv: Vec<OsString>) -> CallToolResult {
    let ran = tokio::task::spawn_blocking(move || run(argv)).await;
    match ran {
        Ok(Ok(json)) => CallToolResult::structured(json),
        Ok(Err(message)) => CallToolResult::error(vec![ContentBlock::text(message)]),
        Err(e) => CallToolResult::error(vec![ContentBlock::text(format!(
            "memsnap: the command stopped: {e}"
        ))]),
    }
}

/// The command's JSON, or its error message as the CLI would print it.
fn run(argv: Vec<OsString>) -> Result<serde_json::Value, String> {
    let command = Reading::try_parse_from(argv).map_err(|e| {
        // clap's first line says what is wrong; the rest points at --help.
        let text = e.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        format!("memsnap: {}", first.trim_start_matches("error: "))
    })?;
    let mut out = Vec::new();
    let ran = match &command {
        Reading::Summary(a) => summary::run(a, &mut out),
        Reading::Diff(a) => diff::run(a, &mut out),
        Reading::Ranks(a) => ranks::run(a, &mut out),
        // Its status 1 (a leak under --fail-on-leak) is not asked for here either.
        Reading::Explain(a) => explain::run(a, &mut out),
        Reading::Whatif(a) => whatif::run(a, &mut out),
    };
    // A status other than 0 (`diff --fail-above`) is not asked for here: the JSON stands.
    ran.map_err(|e| format!("memsnap: {e:#}"))?;
    serde_json::from_slice(&out).map_err(|e| format!("memsnap: the command's JSON: {e}"))
}

/// The answer JSON-RPC 2.0 requires to a line that is not JSON: Parse error, id null
/// (there is no id to read). `None` for JSON, and for a blank line (no message at all).
fn parse_error(line: &[u8]) -> Option<Vec<u8>> {
    let line = line.strip_prefix(b"\xef\xbb\xbf").unwrap_or(line);
    if line.trim_ascii().is_empty() {
        return None;
    }
    let e = serde_json::from_slice::<serde::de::IgnoredAny>(line).err()?;
    let answer = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": -32700, "message": format!("Parse error: {e}")},
    });
    Some(format!("{answer}\n").into_bytes())
}

/// `memsnap mcp`: serves until the client closes stdin. Lines from stdin go to rmcp through
/// a pipe, except those that are not JSON, which are answered here ([`parse_error`]); one
/// task writes stdout, so rmcp's messages and these answers never share a line.
pub fn serve(_: &Args) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let (mut to_rmcp, rmcp_in) = tokio::io::duplex(1 << 16);
        let (rmcp_out, from_rmcp) = tokio::io::duplex(1 << 16);
        let (lines, mut outgoing) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let writer = tokio::spawn(async move {
            let mut stdout = tokio::io::stdout();
            while let Some(line) = outgoing.recv().await {
                stdout.write_all(&line).await?;
                stdout.flush().await?;
            }
            std::io::Result::Ok(())
        });
        let rmcp_lines = lines.clone();
        let relay = tokio::spawn(async move {
            let mut from_rmcp = BufReader::new(from_rmcp);
            loop {
                let mut line = Vec::new();
                if from_rmcp.read_until(b'\n', &mut line).await? == 0
                    || rmcp_lines.send(line).is_err()
                {
                    return std::io::Result::Ok(());
                }
            }
        });
        let reader = tokio::spawn(async move {
            let mut stdin = BufReader::new(tokio::io::stdin());
            loop {
                let mut line = Vec::new();
                if stdin.read_until(b'\n', &mut line).await? == 0 {
                    // Closing the pipe ends rmcp's service.
                    return std::io::Result::Ok(());
                }
                match parse_error(&line) {
                    Some(answer) => {
                        let _ = lines.send(answer);
                    }
                    None => to_rmcp.write_all(&line).await?,
                }
            }
        });
        let service = Server::default()
            .serve((rmcp_in, rmcp_out))
            .await
            .map_err(|e| anyhow::anyhow!("MCP: {e}"))?;
        service
            .waiting()
            .await
            .map_err(|e| anyhow::anyhow!("MCP: {e}"))?;
        // rmcp is done (stdin closed, or it stopped): what it wrote goes out, then the end.
        reader.abort();
        relay.await??;
        writer.await??;
        anyhow::Ok(ExitCode::SUCCESS)
    })
}
