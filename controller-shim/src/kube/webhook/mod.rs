//! The admission webhook, served by the controller over TLS: claims of our StorageClasses
//! take only the guide's access modes, our StorageClasses are written only by the
//! controller, and the fields the guide calls fixed stay fixed. The decisions are in
//! [`rules`]; this module reads the request, finds what it needs, and answers.

pub mod rules;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::core::DynamicObject;
use kube::{Api, Client};
use serde::de::DeserializeOwned;

use super::crd::{MindUstorStorageClass, MindUstorStorageConnection};

#[derive(Debug, Clone)]
pub struct WebhookSettings {
    pub listen: SocketAddr,
    /// The `kubernetes.io/tls` Secret with the serving certificate.
    pub cert_secret: String,
    /// Users that may create ReadWriteMany block claims (exact, or prefixes ending in `*`).
    pub migration_users: Vec<String>,
    /// The controller's own user: the only writer of our StorageClasses.
    pub controller_user: String,
}

struct Shared {
    client: Client,
    settings: WebhookSettings,
}

/// Serves the webhook on `listener` until aborted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    client: Client,
    namespace: String,
    settings: WebhookSettings,
) -> std::io::Result<()> {
    let slot = Arc::new(tls::CertSlot::default());
    let follow = tokio::spawn(tls::follow_secret(
        client.clone(),
        namespace,
        settings.cert_secret.clone(),
        Arc::clone(&slot),
    ));
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
        .with_state(Arc::new(Shared { client, settings }));
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
    follow.abort();
    result
}

async fn validate(
    State(shared): State<Arc<Shared>>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "malformed AdmissionReview");
            return Json(AdmissionResponse::invalid(e.to_string()).into_review());
        }
    };
    let response = AdmissionResponse::from(&request);
    let verdict = decide(&shared, &request).await;
    let kind = request.kind.kind.as_str();
    let name = request.name.as_str();
    Json(
        match verdict {
            Ok(()) => response,
            Err(why) => {
                tracing::info!(kind, name, user = %request.user_info.username.as_deref().unwrap_or(""), %why, "admission denied");
                response.deny(why)
            }
        }
        .into_review(),
    )
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
        "PersistentVolumeClaim" => {
            let claim: PersistentVolumeClaim = typed(request.object.as_ref())?;
            let class = claim
                .spec
                .as_ref()
                .and_then(|s| s.storage_class_name.clone())
                .unwrap_or_default();
            if class.is_empty() || !ours(&shared.client, &class).await {
                return Ok(());
            }
            rules::review_claim(&claim, &user, &settings.migration_users)
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

/// Whether StorageClass `name` is this driver's. When the API cannot tell, the claim is let
/// through: CreateVolume applies the same rules.
async fn ours(client: &Client, name: &str) -> bool {
    let classes: Api<StorageClass> = Api::all(client.clone());
    match classes.get_opt(name).await {
        Ok(class) => class.is_some_and(|c| c.provisioner == csi_common::DRIVER_NAME),
        Err(e) => {
            tracing::warn!(class = name, error = %e, "admission: StorageClass lookup failed; allowing");
            false
        }
    }
}
