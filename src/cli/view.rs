//! `memsnap view SNAP -o page.html` (being written).
use anyhow::Result;
use std::io::Write;
use std::path::PathBuf;
#[derive(clap::Args, Debug)]
pub struct Args {
    pub snap: PathBuf,
    #[arg(short, long)]
    pub output: PathBuf,
}
pub fn run(_a: &Args, _out: &mut dyn Write) -> Result<i32> {
    anyhow::bail!("view: not yet")
}
