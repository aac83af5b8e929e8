//! The uStor backend. The management API is proprietary: the contract this driver assumes is
//! written down in `controller-shim/USTOR_API.md`. What exists so far is the part that decides
//! when to log in ([`login`]) and where the credentials come from ([`credentials`]); the HTTP
//! client and the in-repo server implementing the contract come next.

pub mod credentials;
pub mod login;
