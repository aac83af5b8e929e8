//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: MindUstorStorageConnection: what is wrong with it, the login rules, volumes per connection.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::MindUstorStorageConnection;
use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::Glue;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use std::sync::Arc;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;

use common::*;

/// A Secret in the driver's namespace, applied as `kubectl create secret … | apply` would.
fn put_secret(cluster: &KubeCluster, name: &str, pairs: &[(&str, &str)]) {
    let data: String = pairs
        .iter()
        .map(|(k, v)| format!("  {k}: {v:?}\n"))
        .collect();
    apply(
        cluster,
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: d8-csi-mind-ustor\n\
             stringData:\n{data}"
        ),
    );
}

fn authenticated(status: &controller_shim::kube::crd::ConnectionStatus) -> (String, String) {
    let c = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Authenticated")
        .expect("an Authenticated condition");
    (c.status.clone(), c.reason.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn a_connection_names_what_is_wrong_and_logs_in_by_the_products_rules() {
    let cluster = cluster_with_namespace();
    let ustor = testkit::fake_ustor::FakeUstor::start().await.unwrap();
    ustor.set_user("csi", "S3cret@1", None);
    let client = client(&cluster).await;
    let _glue = Glue::start(client.clone(), test_settings());
    let api: Api<MindUstorStorageConnection> = Api::all(client.clone());
    apply(
        &cluster,
        &connection_yaml("main").replace("https://ustor.example:23004", &ustor.url()),
    );

    // Each missing piece is named, one at a time, and nothing logs in meanwhile.
    wait_connection(&api, "main", "no credentials Secret", |s| {
        reason_has(s, "Secret d8-csi-mind-ustor/creds (spec.controlPlane.credentialsSecretName) does not exist")
    })
    .await;
    put_secret(&cluster, "creds", &[("username", "csi")]);
    wait_connection(&api, "main", "no password", |s| {
        reason_has(s, "has no key password")
    })
    .await;
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret@1")],
    );
    wait_connection(&api, "main", "no TLS Secret", |s| {
        reason_has(
            s,
            "Secret d8-csi-mind-ustor/tls (spec.dataPlane.tlsSecretName) does not exist",
        )
    })
    .await;
    put_secret(&cluster, "tls", &TLS[..4]);
    wait_connection(&api, "main", "no etcd key", |s| {
        reason_has(s, "has no key etcd-client.key")
    })
    .await;
    assert_eq!(
        ustor.logins(),
        0,
        "no login before the connection is complete"
    );

    // Complete: logged in, Created, and the wide listing shows phase and reason.
    put_secret(&cluster, "tls", &TLS);
    let created =
        wait_connection(&api, "main", "Created", |s| s.phase == Some(Phase::Created)).await;
    assert_eq!(authenticated(&created), ("True".into(), "LoggedIn".into()));
    assert_eq!(ustor.logins(), 1);
    let version = api.get("main").await.unwrap().metadata.resource_version;
    assert_not_rewritten(&api, "main", version).await;
    let wide = cluster
        .kubectl(&["get", "mindustorstorageconnections", "-o", "wide"])
        .unwrap();
    let wide = String::from_utf8_lossy(&wide.stdout);
    assert!(
        wide.contains("PHASE") && wide.contains("REASON") && wide.contains("Created"),
        "{wide}"
    );

    // Every refusal uStor can give shows as the Authenticated reason, within seconds of the
    // Secret changing.
    for (i, code) in [
        "UserLocked",
        "PasswordExpired",
        "TemporaryPassword",
        "UserNotFound",
    ]
    .iter()
    .enumerate()
    {
        let password = format!("S3cret@{}", i + 2);
        ustor.set_user("csi", &password, Some(code));
        put_secret(
            &cluster,
            "creds",
            &[("username", "csi"), ("password", &password)],
        );
        let refused = wait_connection(&api, "main", code, |s| authenticated(s).1 == *code).await;
        assert_eq!(refused.phase, Some(Phase::Failed));
        assert!(reason_has(&refused, code), "{:?}", refused.reason);
    }

    // A wrong password: LoginRejected, and no second try with it, whatever triggers a look at
    // the connection.
    ustor.set_user("csi", "S3cret@9", None);
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "wrong")],
    );
    wait_connection(&api, "main", "LoginRejected", |s| {
        authenticated(s).1 == "LoginRejected"
    })
    .await;
    let logins = ustor.logins();
    for n in 0..3 {
        let out = cluster
            .kubectl(&[
                "annotate",
                "--overwrite",
                "mindustorstorageconnection/main",
                &format!("poke={n}"),
            ])
            .unwrap();
        assert!(out.status.success());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        ustor.logins(),
        logins,
        "the refused credentials were tried again within the pause"
    );

    // Credentials uStor's password policy rules out are never sent: Failed, naming the rule
    // (never the password).
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi-user"), ("password", "S3cret@9")],
    );
    wait_connection(&api, "main", "a hyphen in the user name", |s| {
        reason_has(s, "user name has a hyphen")
    })
    .await;
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret#9")],
    );
    let breach = wait_connection(&api, "main", "a special character", |s| {
        reason_has(s, "special character other than @$!%*?&")
    })
    .await;
    assert_eq!(breach.phase, Some(Phase::Failed));
    assert!(
        !breach.reason.unwrap_or_default().contains("S3cret#9"),
        "the password shows in the status"
    );
    assert_eq!(
        ustor.logins(),
        logins,
        "a login was spent on credentials uStor cannot accept"
    );

    // The right password: logged in again within seconds.
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret@9")],
    );
    let again = wait_connection(&api, "main", "logged in again", |s| {
        s.phase == Some(Phase::Created)
    })
    .await;
    assert_eq!(again.reason, None, "the refusal's reason stayed");

    // controlPlane.address never changes.
    let patch = |address: &str| {
        Patch::Merge(serde_json::json!({ "spec": { "controlPlane": { "address": address } } }))
    };
    api.patch(
        "main",
        &PatchParams::default(),
        &patch("https://elsewhere.example:23004"),
    )
    .await
    .unwrap();
    let moved = wait_connection(&api, "main", "address refused", |s| {
        reason_has(s, "cannot be changed")
    })
    .await;
    assert_eq!(moved.phase, Some(Phase::Failed));
    api.patch("main", &PatchParams::default(), &patch(&ustor.url()))
        .await
        .unwrap();
    wait_connection(&api, "main", "back to Created", |s| {
        s.phase == Some(Phase::Created)
    })
    .await;

    // An unreachable management API is told apart from a refusal.
    apply(
        &cluster,
        &connection_yaml("down").replace("https://ustor.example:23004", "http://127.0.0.1:1"),
    );
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret@9")],
    );
    wait_connection(&api, "down", "Unreachable", |s| {
        s.conditions.iter().any(|c| c.reason == "Unreachable")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn volumes_of_two_connections_live_on_their_own_ustor_clusters() {
    use controller_shim::backend::connections::ConnectionsBackend;
    use csi_proto::csi::volume_capability::access_mode::Mode;
    use csi_proto::csi::*;
    use testkit::csi::{controller_publish_request, create_volume_request, mount_capability};

    let cluster = cluster_with_namespace();
    let (alpha, beta) = (
        testkit::fake_ustor::FakeUstor::start().await.unwrap(),
        testkit::fake_ustor::FakeUstor::start().await.unwrap(),
    );
    alpha.set_user("csi", "Alpha@1", None);
    beta.set_user("csi", "Beta@1", None);
    put_secret(
        &cluster,
        "creds-alpha",
        &[("username", "csi"), ("password", "Alpha@1")],
    );
    put_secret(
        &cluster,
        "creds-beta",
        &[("username", "csi"), ("password", "Beta@1")],
    );
    put_secret(&cluster, "tls", &TLS);
    for (name, ustor) in [("alpha", &alpha), ("beta", &beta)] {
        apply(
            &cluster,
            &connection_yaml(name)
                .replace("https://ustor.example:23004", &ustor.url())
                .replace(
                    "credentialsSecretName: creds",
                    &format!("credentialsSecretName: creds-{name}"),
                ),
        );
    }
    let client = client(&cluster).await;
    let glue = Glue::start(client.clone(), test_settings());
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    for name in ["alpha", "beta"] {
        wait_connection(&connections, name, "Created", |s| {
            s.phase == Some(Phase::Created)
        })
        .await;
    }
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "sc-alpha", "alpha").await;
    create_class(&classes, "sc-beta", "beta").await;
    wait_phase(&classes, "sc-alpha", Phase::Created).await;
    wait_phase(&classes, "sc-beta", Phase::Created).await;
    register_node(&cluster, "node-a");

    let dir = tempfile::tempdir().unwrap();
    let backend = ConnectionsBackend::new(Arc::new(glue.connections.clone()), "data");
    let (mut csi, server) = serve_csi(Arc::new(backend), &glue, dir.path()).await;
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    // What external-provisioner sends: the StorageClass's parameters as they are.
    let storage_classes: Api<StorageClass> = Api::all(client.clone());
    let mut ids = Vec::new();
    let mut contexts = Vec::new();
    // beta's data plane requires TLS: its volumes name its TLS profile.
    beta.serve_nbd_over_tls(true);
    for class in ["sc-alpha", "sc-beta"] {
        let parameters = storage_classes
            .get(class)
            .await
            .unwrap()
            .parameters
            .unwrap();
        let volume = csi
            .create_volume(CreateVolumeRequest {
                parameters: parameters.into_iter().collect(),
                ..create_volume_request(&format!("pvc-{class}"), 1 << 20, cap.clone())
            })
            .await
            .unwrap_or_else(|e| panic!("CreateVolume with {class}: {e:?}"))
            .into_inner()
            .volume
            .unwrap();
        ids.push(volume.volume_id);
        contexts.push(volume.volume_context);
    }
    assert!(ids[0].starts_with("ustor:volume:alpha/data/"), "{}", ids[0]);
    assert!(contexts[0]["nbdUri"].starts_with("nbd://"), "{contexts:?}");
    assert!(!contexts[0].contains_key("tlsProfile"), "{contexts:?}");
    assert!(contexts[1]["nbdUri"].starts_with("nbds://"), "{contexts:?}");
    assert_eq!(contexts[1]["tlsProfile"], "beta", "{contexts:?}");
    assert!(ids[1].starts_with("ustor:volume:beta/data/"), "{}", ids[1]);
    assert_eq!(alpha.images(), ["data/k8s-pvc-sc-alpha"]);
    assert_eq!(beta.images(), ["data/k8s-pvc-sc-beta"]);

    // A new password in alpha's Secret: its volumes keep working with it.
    alpha.set_user("csi", "Alpha@2", None);
    put_secret(
        &cluster,
        "creds-alpha",
        &[("username", "csi"), ("password", "Alpha@2")],
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    alpha.expire_tokens();
    let published = csi
        .controller_publish_volume(controller_publish_request(&ids[0], "node-a", cap.clone()))
        .await
        .unwrap_or_else(|e| panic!("publish after the password change: {e:?}"))
        .into_inner();
    assert!(published.publish_context["nbdUri"].starts_with("nbd://"));
    assert!(
        !published.publish_context.contains_key("tlsProfile"),
        "a plaintext export names no TLS profile: {:?}",
        published.publish_context
    );

    // Deleting a MindUstorStorageClass never touches its volumes.
    classes
        .delete("sc-alpha", &DeleteParams::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(alpha.images(), ["data/k8s-pvc-sc-alpha"]);

    // An id of the single-cluster controller (no connection) is the oldest connection's.
    let legacy = ids[0].replace("alpha/", "");
    csi.validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
        volume_id: legacy,
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("a legacy id: {e:?}"));

    csi.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: ids[0].clone(),
        node_id: "node-a".into(),
    })
    .await
    .unwrap();
    csi.delete_volume(DeleteVolumeRequest {
        volume_id: ids[0].clone(),
    })
    .await
    .unwrap();
    assert!(alpha.images().is_empty());

    // A deleted connection's session goes with it: its volumes are refused with the reason,
    // not served by a login nobody manages any more, and its images are left alone.
    connections
        .delete("beta", &DeleteParams::default())
        .await
        .unwrap();
    let refused = eventually("beta's volumes refused", Duration::from_secs(20), || {
        let mut csi = csi.clone();
        let id = ids[1].clone();
        let cap = cap.clone();
        async move {
            csi.validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
                volume_id: id,
                volume_capabilities: vec![cap],
                ..Default::default()
            })
            .await
            .err()
        }
    })
    .await;
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("beta does not exist"),
        "{}",
        refused.message()
    );
    assert_eq!(beta.images(), ["data/k8s-pvc-sc-beta"]);
    server.abort();
}

/// uStor locks a user out after 3 failed logins: credentials it refused are not tried again
/// until the Secret changes, by a session made anew for a new CA, by a restarted controller
/// or through a CSI call, and the status says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn refused_credentials_stay_refused_across_sessions_and_restarts() {
    use controller_shim::backend::connections::ConnectionsBackend;
    use csi_proto::csi::volume_capability::access_mode::Mode;
    use csi_proto::csi::CreateVolumeRequest;
    use testkit::csi::{create_volume_request, mount_capability};

    let cluster = cluster_with_namespace();
    let ustor = testkit::fake_ustor::FakeUstor::start().await.unwrap();
    ustor.set_user("csi", "Right@1", None);
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "Wrong@1")],
    );
    put_secret(&cluster, "tls", &TLS);
    apply(
        &cluster,
        &connection_yaml("main").replace("https://ustor.example:23004", &ustor.url()),
    );
    let client = client(&cluster).await;
    let api: Api<MindUstorStorageConnection> = Api::all(client.clone());
    let session = |glue: &Glue| glue.connections.sessions.get("main");

    let glue = Glue::start(client.clone(), test_settings());
    let refused = wait_connection(&api, "main", "LoginRejected", |s| {
        authenticated(s).1 == "LoginRejected"
    })
    .await;
    assert_eq!(ustor.logins(), 1);
    let record = refused
        .refused_login
        .clone()
        .expect("the refusal is in the status");
    assert_eq!(record.reason, "LoginRejected");
    assert_eq!(record.credentials_digest.len(), 64, "{record:?}");
    assert!(
        reason_has(
            &refused,
            "not tried again until Secret d8-csi-mind-ustor/creds changes"
        ),
        "{:?}",
        refused.reason
    );
    let unchanged = |status: &controller_shim::kube::crd::ConnectionStatus| {
        status.refused_login.as_ref() == Some(&record) && authenticated(status).1 == "LoginRejected"
    };

    // A new CA: the session is made anew, and does not try them.
    let first = session(&glue).unwrap();
    let mut tls = TLS.to_vec();
    tls[0] = ("ca.crt", "another-ca");
    put_secret(&cluster, "tls", &tls);
    eventually("a new session", Duration::from_secs(30), || async {
        session(&glue).filter(|s| !Arc::ptr_eq(s, &first)).map(drop)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        ustor.logins(),
        1,
        "the new session tried refused credentials"
    );

    // A restart, and another replica beside it: neither tries them, nor does a CSI call.
    drop(glue);
    let glue = Glue::start(client.clone(), test_settings());
    let replica = Glue::start(client.clone(), test_settings());
    for g in [&glue, &replica] {
        eventually(
            "the session after the restart",
            Duration::from_secs(30),
            || async { session(g).map(drop) },
        )
        .await;
    }
    let dir = tempfile::tempdir().unwrap();
    let backend = ConnectionsBackend::new(Arc::new(replica.connections.clone()), "data");
    let (mut csi, server) = serve_csi(Arc::new(backend), &replica, dir.path()).await;
    let request = CreateVolumeRequest {
        parameters: [("connection".to_owned(), "main".to_owned())].into(),
        ..create_volume_request(
            "pvc-1",
            1 << 20,
            mount_capability("ext4", Mode::SingleNodeWriter),
        )
    };
    let err = csi.create_volume(request.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    assert!(
        err.message().contains("until they change"),
        "{}",
        err.message()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(ustor.logins(), 1, "refused credentials were tried again");
    let status = api.get("main").await.unwrap().status.unwrap();
    assert!(unchanged(&status), "{status:?}");

    // New credentials: tried at once; the record goes once they are accepted.
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "Right@1")],
    );
    let created =
        wait_connection(&api, "main", "Created", |s| s.phase == Some(Phase::Created)).await;
    assert_eq!(created.refused_login, None, "{created:?}");
    assert_eq!(authenticated(&created), ("True".into(), "LoggedIn".into()));
    assert!(
        created.reason.is_none(),
        "a stale reason: {:?}",
        created.reason
    );
    csi.create_volume(request)
        .await
        .unwrap_or_else(|e| panic!("CreateVolume with the new password: {e:?}"));
    assert_eq!(ustor.images(), ["data/k8s-pvc-1"]);
    server.abort();
}
