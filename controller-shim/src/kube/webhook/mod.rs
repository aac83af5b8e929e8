//! The admission webhook, served by the controller over TLS: claims of our StorageClasses
//! take only the guide's access modes, our StorageClasses are written only by the
//! controller, and the fields the guide calls fixed stay fixed. The decisions are in
//! [`rules`]; this module reads the request, finds what it needs, and answers.
//!
//! Claims come to `/mutate` (a mutating webhook, on CREATE and UPDATE): each one admitted for
//! our StorageClasses is stamped ([`super::stamp`]), and CreateVolume of a ReadWriteMany block
//! volume requires that stamp, so a claim that got past the webhook (down, failing open, or
//! its StorageClass not there yet) is refused at provisioning. Everything else comes to
//! `/validate`.

pub mod issuer;
pub mod rules;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::DynamicObject;
use kube::{Api, Client};
use serde::de::DeserializeOwned;

use super::crd::{MindUstorStorageClass, MindUstorStorageConnection};
use super::key::ControllerKey;
use super::stamp;

#[derive(Debug, Clone)]
pub struct WebhookSettings {
    pub listen: SocketAddr,
    /// The `kubernetes.io/tls` Secret with the serving certificate.
    pub cert_secret: String,
    /// Made and renewed by the controller itself ([`issuer`]); `None` when someone else
    /// (an operator, cert-manager) keeps the Secret and the caBundle.
    pub issue: Option<issuer::IssueSettings>,
    /// Users that may create ReadWriteMany block claims (exact, or prefixes ending in `*`).
    pub migration_users: Vec<String>,
    /// The controller's own user: the only writer of our StorageClasses.
    pub controller_user: String,
}

/// A task that ends when its handle is dropped (a dropped JoinHandle only detaches it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Shared {
    client: Client,
    settings: WebhookSettings,
    /// Signs the stamps of admitted claims.
    key: ControllerKey,
}

/// Serves the webhook on `listener` until aborted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    client: Client,
    namespace: String,
    settings: WebhookSettings,
    key: ControllerKey,
) -> std::io::Result<()> {
    let slot = Arc::new(tls::CertSlot::default());
    // Ended with this task, however it ends (the glue aborts it when dropped).
    let _issuing = settings.issue.clone().map(|issue| {
        AbortOnDrop(tokio::spawn(issuer::keep_issued(
            client.clone(),
            namespace.clone(),
            settings.cert_secret.clone(),
            issue,
        )))
    });
    let _follow = AbortOnDrop(tokio::spawn(tls::follow_secret(
        client.clone(),
        namespace,
        settings.cert_secret.clone(),
        Arc::clone(&slot),
    )));
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(std::io::Error::other)?
    .with_no_client_auth()
    .with_cert_resolver(slot);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let app = Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .with_state(Arc::new(Shared {
            client,
            settings,
            key,
        }));
    tracing::info!(addr = ?listener.local_addr().ok(), "serving the admission webhook");
    let result = loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => break Err(e),
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let stream = match acceptor.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "webhook TLS handshake failed");
                    return;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "webhook connection");
            }
        });
    };
    result
}

/// What the webhook answers a request.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Allow,
    /// Allowed, with the claim's stamp set to this.
    Stamp(String),
    /// Allowed as it is, telling the client why it is not stamped.
    Warn(String),
    Deny(String),
}

impl From<Result<(), String>> for Answer {
    fn from(verdict: Result<(), String>) -> Self {
        verdict.map_or_else(Answer::Deny, |()| Answer::Allow)
    }
}

async fn validate(
    State(shared): State<Arc<Shared>>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    answer(review, |request| async move {
        decide(&shared, &request).await.into()
    })
    .await
}

async fn mutate(
    State(shared): State<Arc<Shared>>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    answer(review, |request| async move {
        match request.kind.kind.as_str() {
            "PersistentVolumeClaim" => admit_claim(&shared, &request).await,
            _ => Answer::Allow,
        }
    })
    .await
}

/// The review's answer as `decide` has it.
async fn answer<F, Fut>(
    review: AdmissionReview<DynamicObject>,
    decide: F,
) -> Json<AdmissionReview<DynamicObject>>
where
    F: FnOnce(Arc<AdmissionRequest<DynamicObject>>) -> Fut,
    Fut: std::future::Future<Output = Answer>,
{
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "malformed AdmissionReview");
            return Json(AdmissionResponse::invalid(e.to_string()).into_review());
        }
    };
    let request = Arc::new(request);
    let mut response = AdmissionResponse::from(&*request);
    let verdict = decide(Arc::clone(&request)).await;
    let kind = request.kind.kind.as_str();
    let name = request.name.as_str();
    let user = request.user_info.username.as_deref().unwrap_or("");
    Json(
        match verdict {
            Answer::Allow => response,
            Answer::Stamp(stamp) => {
                let object = request.object.as_ref();
                match response.clone().with_patch(stamp_patch(object, stamp)) {
                    Ok(patched) => {
                        tracing::info!(kind, name, user, "admitted and stamped");
                        patched
                    }
                    Err(e) => {
                        tracing::error!(kind, name, error = %e, "the stamp patch; admitted without it");
                        response
                    }
                }
            }
            Answer::Warn(why) => {
                tracing::warn!(kind, name, user, %why, "admitted without a stamp");
                response.warnings = Some(vec![why]);
                response
            }
            Answer::Deny(why) => {
                tracing::info!(kind, name, user, %why, "admission denied");
                response.deny(why)
            }
        }
        .into_review(),
    )
}

/// The JSON patch that sets the stamp annotation of `object` to `stamp`.
fn stamp_patch(object: Option<&DynamicObject>, stamp: String) -> Patch {
    let has_annotations = object.is_some_and(|o| o.metadata.annotations.is_some());
    let (path, value) = if has_annotations {
        (
            PointerBuf::from_tokens(["metadata", "annotations", stamp::ANNOTATION]),
            serde_json::Value::String(stamp),
        )
    } else {
        (
            PointerBuf::from_tokens(["metadata", "annotations"]),
            serde_json::json!({ stamp::ANNOTATION: stamp }),
        )
    };
    Patch(vec![PatchOperation::Add(AddOperation { path, value })])
}

/// A claim's CREATE or UPDATE: the rules' verdict, and the stamp for a claim of ours they
/// allow.
async fn admit_claim(shared: &Shared, request: &AdmissionRequest<DynamicObject>) -> Answer {
    let claim: PersistentVolumeClaim = match typed(request.object.as_ref()) {
        Ok(claim) => claim,
        Err(why) => return Answer::Deny(why),
    };
    let class = storage_class(&claim);
    match class_of(&shared.client, &class).await {
        Class::Ours => {}
        Class::Other => return Answer::Allow,
        Class::Unknown(why) => {
            return Answer::Warn(format!(
                "{}: StorageClass {class} could not be read ({why}), so the claim is not admitted for it: \
                 a ReadWriteMany block volume of it will be refused; update the claim to have it reviewed",
                csi_common::DRIVER_NAME
            ))
        }
    }
    let user = request.user_info.username.clone().unwrap_or_default();
    let migration = &shared.settings.migration_users;
    let allowed = match (&request.operation, request.old_object.as_ref()) {
        (Operation::Create, _) => rules::review_claim(&claim, &user, migration).map(|()| true),
        (Operation::Update, Some(old)) => match typed::<PersistentVolumeClaim>(Some(old)) {
            Ok(old) => rules::review_claim_update(&old, &claim, &user, migration),
            Err(why) => Err(why),
        },
        _ => Ok(false),
    };
    match allowed {
        Err(why) => Answer::Deny(why),
        Ok(false) => Answer::Allow,
        Ok(true) => {
            let namespace = request
                .namespace
                .clone()
                .or_else(|| claim.metadata.namespace.clone())
                .unwrap_or_default();
            let current = claim
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(stamp::ANNOTATION));
            match stamp::stamp(&shared.key, &namespace, &claim) {
                Some(s) if current == Some(&s) => Answer::Allow,
                Some(s) => Answer::Stamp(s),
                None => Answer::Warn(format!(
                    "{}: the controller's key is not loaded yet, so the claim is admitted without its stamp: \
                     a ReadWriteMany block volume of it will be refused until the claim is updated",
                    csi_common::DRIVER_NAME
                )),
            }
        }
    }
}

/// The object of a request as the type its kind names.
fn typed<T: DeserializeOwned>(object: Option<&DynamicObject>) -> Result<T, String> {
    let value = serde_json::to_value(object.ok_or("the request carries no object")?)
        .map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| format!("the object cannot be read: {e}"))
}

async fn decide(shared: &Shared, request: &AdmissionRequest<DynamicObject>) -> Result<(), String> {
    let user = request.user_info.username.clone().unwrap_or_default();
    let settings = &shared.settings;
    match request.kind.kind.as_str() {
        // A configuration that still sends claims here (before its upgrade to /mutate):
        // judged, not stamped.
        "PersistentVolumeClaim" => {
            let claim: PersistentVolumeClaim = typed(request.object.as_ref())?;
            match class_of(&shared.client, &storage_class(&claim)).await {
                Class::Ours => rules::review_claim(&claim, &user, &settings.migration_users),
                Class::Other | Class::Unknown(_) => Ok(()),
            }
        }
        "StorageClass" => {
            let class: StorageClass = typed(request.object.as_ref())?;
            rules::review_storage_class(&class, &user, &settings.controller_user)
        }
        "MindUstorStorageConnection" if request.old_object.is_some() => {
            let old: MindUstorStorageConnection = typed(request.old_object.as_ref())?;
            let new: MindUstorStorageConnection = typed(request.object.as_ref())?;
            rules::review_connection_update(&old, &new)
        }
        "MindUstorStorageClass" if request.old_object.is_some() => {
            let old: MindUstorStorageClass = typed(request.old_object.as_ref())?;
            let new: MindUstorStorageClass = typed(request.object.as_ref())?;
            rules::review_class_update(&old, &new)
        }
        _ => Ok(()),
    }
}

/// The StorageClass a claim names (empty when none).
fn storage_class(claim: &PersistentVolumeClaim) -> String {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap_or_default()
}

/// Whose a claim's StorageClass is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Class {
    /// This driver's, or to be: a MindUstorStorageClass of that name exists, whose
    /// StorageClass the controller is about to make.
    Ours,
    /// Another driver's, none, or one nobody defined.
    Other,
    /// The API could not tell.
    Unknown(String),
}

async fn class_of(client: &Client, name: &str) -> Class {
    if name.is_empty() {
        return Class::Other;
    }
    let classes: Api<StorageClass> = Api::all(client.clone());
    let result = match classes.get_opt(name).await {
        Ok(Some(class)) if class.provisioner == csi_common::DRIVER_NAME => Ok(Class::Ours),
        Ok(Some(_)) => Ok(Class::Other),
        Ok(None) => Api::<MindUstorStorageClass>::all(client.clone())
            .get_opt(name)
            .await
            .map(|c| {
                if c.is_some() {
                    Class::Ours
                } else {
                    Class::Other
                }
            }),
        Err(e) => Err(e),
    };
    result.unwrap_or_else(|e| {
        tracing::warn!(class = name, error = %e, "admission: StorageClass lookup failed");
        Class::Unknown(e.to_string())
    })
}
