//! Arguments several commands share: `--ignore`, `--callers` and `--at-helpers`
//! ([`Attribution`], turned into the engine's site rules, docs/EXPLAIN.md#sites), and with
//! `--json` the [`Report`] of the reading commands.
//! Cold code.

use memsnap_engine::sites;

/// How the allocation site is chosen and shown: `--ignore`, `--callers` and
/// `--at-helpers`, the same for every command.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Attribution {
    /// Skip frames whose file or function contains PATTERN when choosing the allocation
    /// site (repeatable): `--ignore pyalloc.py` blames the caller of a helper in pyalloc.py.
    #[arg(long = "ignore", value_name = "PATTERN")]
    pub ignore: Vec<String>,
    /// Show N frames above each allocation site (its callers), as `site <- caller <- ...`;
    /// sites are then grouped by the whole chain (and helpers are not looked for).
    #[arg(long, value_name = "N")]
    pub callers: Option<usize>,
    /// Show a helper's allocations at the helper's own line. By default a function of the
    /// program that allocates for several calling lines (`def alloc(n)`, a cache's `get`, a
    /// wrapper around cudaMalloc) is named beside them: `train.py:88 (step) via
    /// cache.py:12 (get)`.
    #[arg(long)]
    pub at_helpers: bool,
}

impl Attribution {
    /// The engine's site rules these arguments ask for.
    pub fn rules(&self) -> sites::Attribution {
        sites::Attribution {
            ignore: self.ignore.clone(),
            callers: self.callers,
            helpers: if self.at_helpers {
                sites::HelperRule::Off
            } else {
                sites::HelperRule::Find
            },
        }
    }
}

/// How a reading command (`summary`, `diff`, `explain`, `ranks`) reports: its site rules,
/// and text or JSON.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Report {
    #[command(flatten)]
    pub attr: Attribution,
    /// Print JSON instead of text (shape: see --help).
    #[arg(long)]
    pub json: bool,
}
