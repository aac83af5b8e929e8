//! CSI `mount_flags` turned into mount(2) flags and filesystem data.

use nix::mount::MsFlags;

use crate::Error;

/// Mount flags and the filesystem-specific data string, as mount(2) takes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    pub flags: MsFlags,
    /// Comma-separated filesystem options (`discard`, `data=ordered`, …).
    pub data: Vec<String>,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            flags: MsFlags::empty(),
            data: Vec::new(),
        }
    }
}

impl MountOptions {
    /// Splits `mount -o`-style words into flags and data. Options that would change what a
    /// mount is rather than how it behaves (`bind`, `remount`, `move`, …) are refused: the
    /// daemon decides those itself.
    pub fn parse<S: AsRef<str>>(words: &[S]) -> Result<Self, Error> {
        let mut opts = Self::default();
        for word in words.iter().flat_map(|w| w.as_ref().split(',')) {
            let word = word.trim();
            if word.is_empty() {
                continue;
            }
            match flag(word) {
                Some(Flag::Set(f)) => opts.flags |= f,
                Some(Flag::Clear(f)) => opts.flags &= !f,
                Some(Flag::Forbidden) => return Err(Error::ForbiddenOption(word.to_owned())),
                None => opts.data.push(word.to_owned()),
            }
        }
        Ok(opts)
    }

    pub fn read_only(&self) -> bool {
        self.flags.contains(MsFlags::MS_RDONLY)
    }

    pub fn data_string(&self) -> Option<String> {
        (!self.data.is_empty()).then(|| self.data.join(","))
    }
}

enum Flag {
    Set(MsFlags),
    Clear(MsFlags),
    Forbidden,
}

fn flag(word: &str) -> Option<Flag> {
    use Flag::*;
    Some(match word {
        "ro" => Set(MsFlags::MS_RDONLY),
        "rw" => Clear(MsFlags::MS_RDONLY),
        "nosuid" => Set(MsFlags::MS_NOSUID),
        "suid" => Clear(MsFlags::MS_NOSUID),
        "nodev" => Set(MsFlags::MS_NODEV),
        "dev" => Clear(MsFlags::MS_NODEV),
        "noexec" => Set(MsFlags::MS_NOEXEC),
        "exec" => Clear(MsFlags::MS_NOEXEC),
        "sync" => Set(MsFlags::MS_SYNCHRONOUS),
        "async" => Clear(MsFlags::MS_SYNCHRONOUS),
        "dirsync" => Set(MsFlags::MS_DIRSYNC),
        "noatime" => Set(MsFlags::MS_NOATIME),
        "atime" => Clear(MsFlags::MS_NOATIME),
        "nodiratime" => Set(MsFlags::MS_NODIRATIME),
        "diratime" => Clear(MsFlags::MS_NODIRATIME),
        "relatime" => Set(MsFlags::MS_RELATIME),
        "norelatime" => Clear(MsFlags::MS_RELATIME),
        "strictatime" => Set(MsFlags::MS_STRICTATIME),
        "lazytime" => Set(MsFlags::MS_LAZYTIME),
        "nolazytime" => Clear(MsFlags::MS_LAZYTIME),
        "defaults" => Clear(MsFlags::empty()),
        "bind" | "rbind" | "remount" | "move" | "shared" | "rshared" | "private" | "rprivate"
        | "slave" | "rslave" | "unbindable" | "runbindable" | "loop" => Forbidden,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_data_are_split() {
        let o = MountOptions::parse(&["noatime,discard", "ro", "data=ordered"]).unwrap();
        assert_eq!(o.flags, MsFlags::MS_NOATIME | MsFlags::MS_RDONLY);
        assert_eq!(o.data_string().as_deref(), Some("discard,data=ordered"));
        assert!(o.read_only());
    }

    #[test]
    fn later_words_win_and_empty_is_fine() {
        let o = MountOptions::parse(&["ro", "rw", ""]).unwrap();
        assert!(!o.read_only());
        assert_eq!(o.data_string(), None);
        assert_eq!(
            MountOptions::parse::<&str>(&[]).unwrap(),
            MountOptions::default()
        );
    }

    #[test]
    fn structural_options_are_refused() {
        for bad in ["bind", "remount", "rshared", "loop"] {
            assert!(
                matches!(MountOptions::parse(&[bad]), Err(Error::ForbiddenOption(o)) if o == bad)
            );
        }
    }
}
