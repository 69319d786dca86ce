//! The names of memsnap's hidden temporaries, and the removal of those a killed process left.
//!
//! Cold (writer thread). A temporary is named `.memsnap-tmp.HOST.BOOT.PIDNS.PID.RANDOM`: the
//! prefix is memsnap's own, HOST the host name, BOOT the kernel's boot id (32 hex digits),
//! PIDNS the process's pid namespace, PID its pid and RANDOM 16 hex digits (not guessable
//! in advance). Only a name of exactly that form whose host, boot and pid namespace are this
//! process's, whose pid is not alive, and which is a regular file of this user is ever
//! removed: nothing else can be proven memsnap's. A temporary of another host or another
//! boot is left alone (a host name alone does not prove it is this machine: two containers
//! on two machines may share one, and only the boot id tells them apart), as is any name
//! that does not parse exactly (the user's `.notes.tmp.99999999`).

use std::fs;
use std::path::Path;

const PREFIX: &str = ".memsnap-tmp.";

/// What a temporary's name says about the process that made it, read once.
#[derive(Clone, Debug)]
pub struct Maker {
    host: String,
    /// The boot id without dashes; `None` when the kernel does not tell it.
    boot: Option<String>,
    /// The inode of `/proc/self/ns/pid`; `None` when it cannot be read.
    pid_namespace: Option<u64>,
}

impl Maker {
    pub fn current() -> Maker {
        let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|id| id.trim().replace('-', ""))
            .filter(|id| id.len() == 32 && is_lower_hex(id));
        let pid_namespace = fs::read_link("/proc/self/ns/pid").ok().and_then(|link| {
            let link = link.to_string_lossy().into_owned();
            link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
        });
        Maker {
            host: crate::config::sanitize(&crate::config::hostname()),
            boot,
            pid_namespace,
        }
    }

    /// The name of a new temporary of process `pid`.
    pub fn name(&self, pid: u32, random: u64) -> String {
        let boot = self.boot.as_deref().unwrap_or("unknown");
        let namespace = self
            .pid_namespace
            .map_or_else(|| "unknown".to_string(), |ns| ns.to_string());
        format!(
            "{PREFIX}{}.{boot}.{namespace}.{pid}.{random:016x}",
            self.host
        )
    }

    /// The pid of the process that made `file_name`, when it is a temporary of exactly
    /// [`Maker::name`]'s form made on this host, in this boot and pid namespace; `None` for
    /// anything else (or when this process cannot tell its boot or namespace).
    pub fn maker_pid(&self, file_name: &str) -> Option<u32> {
        let ours = format!(
            "{PREFIX}{}.{}.{}.",
            self.host,
            self.boot.as_deref()?,
            self.pid_namespace?
        );
        let (pid, random) = file_name.strip_prefix(&ours)?.split_once('.')?;
        let canonical = !pid.starts_with('0') && pid.bytes().all(|b| b.is_ascii_digit());
        if !canonical || random.len() != 16 || !is_lower_hex(random) {
            return None;
        }
        pid.parse().ok().filter(|&pid| pid > 0)
    }
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The names in `listing` that are temporaries `maker` can prove were left by a process of
/// this host, boot and pid namespace that no longer exists (not this one).
pub fn stale<'a>(maker: &Maker, listing: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let me = std::process::id();
    listing
        .filter(|name| {
            maker
                .maker_pid(name)
                .is_some_and(|pid| pid != me && !process_exists(pid))
        })
        .collect()
}

/// Whether a process with this pid exists (or /proc cannot tell: then assume it does).
pub fn process_exists(pid: u32) -> bool {
    if !Path::new("/proc/self").exists() {
        return true;
    }
    Path::new(&format!("/proc/{pid}")).exists()
}

/// A random 64-bit value for a temporary's name.
pub fn random_u64() -> u64 {
    let mut value = 0u64;
    // SAFETY: getrandom fills at most 8 bytes of a local u64.
    let got = unsafe { libc::getrandom((&mut value as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
    if got != 8 {
        // No entropy source answered: the clock's nanoseconds, mixed, still change per call.
        value = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid no process can have (above the kernel's largest pid_max, 2^22).
    const DEAD: u32 = u32::MAX - 7;

    fn here() -> Maker {
        Maker {
            host: "node7.example.com".into(),
            boot: Some("17ae66018f094ec6a234b7e55477f742".into()),
            pid_namespace: Some(4026531836),
        }
    }

    #[test]
    fn a_name_parses_back_to_its_pid_only_when_it_is_exactly_ours() {
        let maker = here();
        let name = maker.name(4242, 0xff);
        assert_eq!(
            name,
            ".memsnap-tmp.node7.example.com.17ae66018f094ec6a234b7e55477f742.4026531836.4242.00000000000000ff"
        );
        assert_eq!(maker.maker_pid(&name), Some(4242));
        for not_ours in [
            format!("{name}.bak"),
            name.replace(".4242.", ".04242."),
            name.replace(".4242.", ".+4242."),
            name.replace(".4242.", ".0."),
            name.replace("00ff", "00FF"),
            name.replace(".00000000000000ff", ".0ff"),
            name.replace("node7", "node8"),
            name.replace("17ae", "27ae"),
            name.replace("4026531836", "4026531837"),
            ".notes.tmp.99999999".into(),
            ".config.json.tmp.3141592653".into(),
            ".report.md.tmp.424242.bak".into(),
            ".snap.pickle.tmp.4242.00ff00ff00ff00ff".into(),
        ] {
            assert_eq!(maker.maker_pid(&not_ours), None, "{not_ours}");
        }
    }

    #[test]
    fn without_a_boot_id_or_namespace_nothing_is_provably_ours() {
        let mut maker = here();
        maker.boot = None;
        let name = maker.name(DEAD, 1);
        assert!(name.contains(".unknown."), "{name}");
        assert_eq!(maker.maker_pid(&name), None);
        let mut maker = here();
        maker.pid_namespace = None;
        assert_eq!(maker.maker_pid(&maker.name(DEAD, 1)), None);
    }

    #[test]
    fn only_a_dead_process_of_this_boot_leaves_stale_temporaries() {
        let maker = here();
        let dead = maker.name(DEAD, 1);
        let alive = maker.name(1, 2);
        let mine = maker.name(std::process::id(), 3);
        let mut other_boot = here();
        other_boot.boot = Some("0".repeat(32));
        let elsewhere = other_boot.name(DEAD, 4);
        let names = [
            dead.as_str(),
            alive.as_str(),
            mine.as_str(),
            elsewhere.as_str(),
            ".notes.tmp.99999999",
        ];
        assert_eq!(stale(&maker, names.into_iter()), vec![dead.as_str()]);
    }

    #[test]
    fn the_real_maker_names_differ_each_time() {
        let maker = Maker::current();
        let a = maker.name(std::process::id(), random_u64());
        let b = maker.name(std::process::id(), random_u64());
        assert_ne!(a, b);
        assert_eq!(maker.maker_pid(&a), Some(std::process::id()));
    }
}
