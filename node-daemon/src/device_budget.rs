//! How many nbd devices are left to this driver: the figure NodeGetInfo gives kubelet (the
//! scheduler's attach limit for the node) and the one `preflight` checks. Kernels >= 6.5
//! create no device past `nbds_max` through netlink; older ones would create more, but the
//! packaged `nbds_max` is the limit this driver keeps to on both lines, so the scheduler sees
//! one figure whatever the kernel.

use std::path::Path;

use nbd::sysfs::Sysfs;

use crate::ids::Identifier;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBudget {
    pub nbds_max: u64,
    /// Devices carrying this driver's identifier (this node's or another node id's).
    pub ours: u64,
    /// Devices other tools hold: a foreign identifier, or none but connected (nbd-client).
    pub others: u64,
}

impl DeviceBudget {
    /// `None` when the nbd module is not loaded (or its parameter cannot be read).
    pub fn read(sys_module: &Path, sysfs: &Sysfs) -> Option<Self> {
        let nbds_max = std::fs::read_to_string(sys_module.join("nbd/parameters/nbds_max"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let mut budget = Self {
            nbds_max,
            ours: 0,
            others: 0,
        };
        for index in sysfs.devices().unwrap_or_default() {
            match sysfs.backend(index).ok().flatten() {
                Some(b) if Identifier::parse(&b).is_some() => budget.ours += 1,
                Some(_) => budget.others += 1,
                None if sysfs.in_use(index).unwrap_or(false) => budget.others += 1,
                None => {}
            }
        }
        Some(budget)
    }

    /// The volumes this driver can hold on the node: `nbds_max` less what other tools hold.
    pub fn for_this_driver(&self) -> u64 {
        self.nbds_max.saturating_sub(self.others)
    }

    /// Devices nobody uses now.
    pub fn free(&self) -> u64 {
        self.nbds_max.saturating_sub(self.ours + self.others)
    }
}
