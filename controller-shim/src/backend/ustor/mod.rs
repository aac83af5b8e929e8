//! The uStor backend. The management API is proprietary: the contract this driver assumes is
//! written down in `controller-shim/USTOR_API.md`. [`login`] decides when to log in,
//! [`credentials`] reads them from a Secret mount, [`api`] is the HTTP client, [`backend`] the
//! `Backend` over it.

pub mod api;
pub mod backend;
pub mod credentials;
pub mod error;
pub mod login;
