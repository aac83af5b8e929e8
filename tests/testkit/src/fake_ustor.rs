//! An in-repo server implementing exactly the uStor management API contract of
//! `controller-shim/USTOR_API.md` (login, pools, images, snapshots, grants), in memory, over plain
//! HTTP on loopback. Tests steer it: which users exist and why a login is refused, token
//! expiry, and they read how many logins reached it.
//!
//! By default it holds no data. With [`FakeUstor::serve_data_from`] its images are sparse files
//! in a directory that a real NBD server (`nbdkit file dir=…`) serves by export name, and each
//! live grant is a hard link `<export>@<token>` to its image, so a node opens an image only by
//! a live grant's name, as the contract says. (Unlike uStor, a revoke does not cut connections
//! already open, and a name without a grant gets nbdkit's "unknown export", not a policy
//! refusal: the fencing tests use the local backend's gate for those.)

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde_json::{json, Value};

#[derive(Debug, Default)]
struct Inner {
    /// username → (password, refusal code if logins are refused).
    users: Mutex<HashMap<String, (String, Option<String>)>>,
    tokens: Mutex<Vec<String>>,
    images: Mutex<HashMap<String, Value>>,
    snapshots: Mutex<HashMap<String, Value>>,
    /// Group snapshot records, keyed `<pool>/<name>`.
    groups: Mutex<HashMap<String, Value>>,
    /// Image key → node → its grant. It serves no NBD, so a revoke has nothing to cut.
    grants: Mutex<HashMap<String, BTreeMap<String, FakeGrant>>>,
    logins: AtomicUsize,
    /// GETs of one image, counted: a listing should not need them.
    image_gets: AtomicUsize,
    /// New images' NBD endpoints require TLS.
    nbd_tls: std::sync::atomic::AtomicBool,
    /// Routes whose requests wait at the server, as at one that stalls (see [`Hold`]).
    holds: Mutex<Vec<Arc<HeldRoute>>>,
    /// Where images keep their data, once a test asked for it.
    data: std::sync::OnceLock<DataPlane>,
}

/// Images as files in `dir`, served by the NBD server at `nbd`.
#[derive(Debug)]
struct DataPlane {
    dir: std::path::PathBuf,
    nbd: SocketAddr,
}

impl DataPlane {
    fn image(&self, export: &str) -> std::path::PathBuf {
        self.dir.join(export)
    }

    fn grant(&self, export: &str, token: &str) -> std::path::PathBuf {
        self.dir.join(format!("{export}@{token}"))
    }
}

/// A failed file operation of the data plane, as uStor would answer an internal failure.
fn storage_error(what: &str, e: std::io::Error) -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Internal",
        &format!("{what}: {e}"),
    )
}

/// One held route: how many of its requests arrived, and whether they may go on.
#[derive(Debug)]
struct HeldRoute {
    method: axum::http::Method,
    path: String,
    arrived: tokio::sync::watch::Sender<usize>,
    open: tokio::sync::watch::Sender<bool>,
}

/// Requests of one route (method and exact path) held at the server until the hold is
/// dropped: a test makes a call of the controller wait inside uStor for as long as it likes.
#[derive(Debug)]
pub struct Hold {
    route: Arc<HeldRoute>,
    server: Arc<Inner>,
}

impl Hold {
    /// Waits until `n` requests of the route have arrived (and are held).
    pub async fn arrived(&self, n: usize) {
        let mut arrived = self.route.arrived.subscribe();
        // The sender lives in `self.route`: the wait ends only when `n` have arrived.
        let _ = arrived.wait_for(|&a| a >= n).await;
    }

    /// How many requests of the route have arrived so far.
    pub fn count(&self) -> usize {
        *self.route.arrived.borrow()
    }
}

impl Drop for Hold {
    /// Lets the held requests, and every later one, through.
    fn drop(&mut self) {
        self.server
            .holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|r| !Arc::ptr_eq(r, &self.route));
        self.route.open.send_replace(true);
    }
}

/// (read-only, token).
type FakeGrant = (bool, String);

#[derive(Debug, Clone)]
pub struct FakeUstor {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
    task: Arc<tokio::task::JoinHandle<()>>,
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"code": code, "message": message}})),
    )
        .into_response()
}

impl FakeUstor {
    pub async fn start() -> std::io::Result<Self> {
        let inner = Arc::new(Inner::default());
        let app = Router::new()
            .route("/api/v1/pools", get(list_pools))
            .route("/api/v1/pools/{pool}", get(pool))
            .route(
                "/api/v1/pools/{pool}/images",
                post(create_image).get(list_images),
            )
            .route(
                "/api/v1/pools/{pool}/images/{name}",
                get(get_image).patch(patch_image).delete(delete_image),
            )
            .route(
                "/api/v1/pools/{pool}/images/{name}/snapshots",
                post(create_snapshot),
            )
            .route(
                "/api/v1/pools/{pool}/images/{name}/grants",
                get(list_grants),
            )
            .route(
                "/api/v1/pools/{pool}/images/{name}/grants/{node}",
                put(put_grant).delete(delete_grant),
            )
            .route("/api/v1/pools/{pool}/snapshots", get(list_snapshots))
            .route("/api/v1/pools/{pool}/snapshot-groups", post(create_group))
            .route(
                "/api/v1/pools/{pool}/snapshot-groups/{name}",
                get(get_group).delete(delete_group),
            )
            .route(
                "/api/v1/pools/{pool}/snapshots/{name}",
                get(get_snapshot).delete(delete_snapshot),
            )
            // Every route above needs a token; the login below gives them out.
            .route_layer(middleware::from_fn_with_state(
                Arc::clone(&inner),
                require_token,
            ))
            .route("/api/v1/auth/login", post(login))
            .with_state(Arc::clone(&inner));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            inner,
            addr,
            task: Arc::new(task),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Adds a user; `refusal` makes every login of it fail with that code.
    pub fn set_user(&self, name: &str, password: &str, refusal: Option<&str>) {
        self.inner
            .users
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.into(), (password.into(), refusal.map(String::from)));
    }

    /// Logins that reached the server.
    pub fn logins(&self) -> usize {
        self.inner.logins.load(Ordering::SeqCst)
    }

    /// How many GETs of a single image it answered.
    pub fn image_gets(&self) -> usize {
        self.inner.image_gets.load(Ordering::SeqCst)
    }

    /// Keys (`<pool>/<image>`) of the images it holds, sorted.
    pub fn images(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .inner
            .images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    }

    /// Adds the image `key` (`<pool>/<image>`) as another tool made it: `labels` (none of
    /// this driver's, for an old product's image), exported by the NBD server at `nbd`.
    pub fn add_image(&self, key: &str, size: u64, labels: Value, nbd: SocketAddr) {
        let (_, name) = key.split_once('/').expect("a key is <pool>/<image>");
        let image = json!({"name": name, "sizeBytes": size, "labels": labels,
            "nbd": {"host": nbd.ip().to_string(), "port": nbd.port(), "export": name, "tls": false}});
        self.inner
            .images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_owned(), image);
    }

    /// The labels of image `key`, if it exists.
    pub fn labels(&self, key: &str) -> Option<Value> {
        self.inner
            .images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .map(|image| image["labels"].clone())
    }

    /// The token of `node`'s live grant of image `key` (`<pool>/<image>`).
    pub fn grant_token(&self, key: &str, node: &str) -> Option<String> {
        self.inner
            .grants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)?
            .get(node)
            .map(|(_, token)| token.clone())
    }

    /// Images created from now on hold their data in `dir` (sparse files named by export),
    /// served by the NBD server that listens at `nbd` (`nbdkit file dir=<dir>`); grants are
    /// hard links `<export>@<token>` there. Once per server.
    pub fn serve_data_from(&self, dir: &std::path::Path, nbd: SocketAddr) {
        let plane = DataPlane {
            dir: dir.to_owned(),
            nbd,
        };
        assert!(
            self.inner.data.set(plane).is_ok(),
            "the data plane is set once"
        );
    }

    /// Images created from now on are served over TLS (their `nbd.tls` is true).
    pub fn serve_nbd_over_tls(&self, on: bool) {
        self.inner.nbd_tls.store(on, Ordering::SeqCst);
    }

    /// Holds every `method` request of `path` (e.g. `DELETE`, `/api/v1/pools/p/images/i`)
    /// at the server until the returned [`Hold`] is dropped.
    pub fn hold(&self, method: &str, path: &str) -> Hold {
        let route = Arc::new(HeldRoute {
            method: method
                .parse()
                .unwrap_or_else(|e| panic!("method {method:?}: {e}")),
            path: path.to_owned(),
            arrived: tokio::sync::watch::Sender::new(0),
            open: tokio::sync::watch::Sender::new(false),
        });
        self.inner
            .holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::clone(&route));
        Hold {
            route,
            server: Arc::clone(&self.inner),
        }
    }

    /// Every token issued so far expires: the next call answers 401 TokenExpired.
    pub fn expire_tokens(&self) {
        self.inner
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

impl Drop for FakeUstor {
    fn drop(&mut self) {
        if Arc::strong_count(&self.task) == 1 {
            self.task.abort();
        }
    }
}

type St = State<Arc<Inner>>;

fn authorized(s: &Inner, headers: &HeaderMap) -> bool {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    s.tokens
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|t| t == token)
}

/// GET of one object: 200 with it, or 404.
fn fetch(map: &Mutex<HashMap<String, Value>>, key: &str, what: &str) -> Response {
    match map.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
        Some(v) => Json(v.clone()).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("no such {what}"),
        ),
    }
}

/// DELETE of one object: 204, or 404.
fn take(map: &Mutex<HashMap<String, Value>>, key: &str, what: &str) -> Response {
    match map.lock().unwrap_or_else(|p| p.into_inner()).remove(key) {
        Some(_) => StatusCode::NO_CONTENT.into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("no such {what}"),
        ),
    }
}

/// A call without a token the login gave out is answered 401 `TokenExpired`.
async fn require_token(State(s): St, request: Request, next: Next) -> Response {
    if authorized(&s, request.headers()) {
        let held = s
            .holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|r| r.method == *request.method() && r.path == request.uri().path())
            .cloned();
        if let Some(route) = held {
            route.arrived.send_modify(|a| *a += 1);
            let mut open = route.open.subscribe();
            let _ = open.wait_for(|&o| o).await;
        }
        next.run(request).await
    } else {
        error(StatusCode::UNAUTHORIZED, "TokenExpired", "log in again")
    }
}

async fn login(State(s): St, Json(body): Json<Value>) -> Response {
    s.logins.fetch_add(1, Ordering::SeqCst);
    let user = body["username"].as_str().unwrap_or_default();
    let password = body["password"].as_str().unwrap_or_default();
    let users = s.users.lock().unwrap_or_else(|p| p.into_inner()).clone();
    match users.get(user) {
        None => error(StatusCode::UNAUTHORIZED, "UserNotFound", "no such user"),
        Some((_, Some(reason))) => error(StatusCode::UNAUTHORIZED, reason, "refused"),
        Some((p, None)) if p != password => {
            error(StatusCode::UNAUTHORIZED, "LoginRejected", "wrong password")
        }
        Some(_) => {
            let token = format!("t{}", s.logins.load(Ordering::SeqCst));
            s.tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(token.clone());
            Json(json!({"token": token, "expiresIn": 3600})).into_response()
        }
    }
}

/// The pools: `data` and every pool an image was created in (any name is a pool here).
async fn list_pools(State(s): St) -> Response {
    let mut names: std::collections::BTreeSet<String> = s
        .images
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .keys()
        .filter_map(|k| k.split_once('/').map(|(pool, _)| pool.to_owned()))
        .collect();
    names.insert("data".into());
    let pools: Vec<Value> = names
        .into_iter()
        .map(|name| json!({"name": name, "totalBytes": 1u64 << 40, "freeBytes": 1u64 << 38}))
        .collect();
    Json(json!({"pools": pools})).into_response()
}

async fn list_images(State(s): St, Path(pool): Path<String>) -> Response {
    Json(json!({"images": in_pool(&s.images, &pool)})).into_response()
}

async fn pool(Path(pool): Path<String>) -> Response {
    // Pools differ, so a test can tell which one was asked.
    let free: u64 = if pool == "data" { 1 << 39 } else { 1 << 38 };
    Json(json!({"name": pool, "totalBytes": 1u64 << 40, "freeBytes": free})).into_response()
}

async fn create_image(State(s): St, Path(pool): Path<String>, Json(body): Json<Value>) -> Response {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let Some(size) = body["sizeBytes"].as_u64() else {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidArgument",
            "sizeBytes is required",
        );
    };
    let mut images = s.images.lock().unwrap_or_else(|p| p.into_inner());
    let key = format!("{pool}/{name}");
    if images.contains_key(&key) {
        return error(StatusCode::CONFLICT, "AlreadyExists", "image exists");
    }
    let tls = s.nbd_tls.load(Ordering::SeqCst);
    let nbd = match s.data.get() {
        Some(plane) => {
            let made = std::fs::File::create_new(plane.image(&name)).and_then(|f| f.set_len(size));
            if let Err(e) = made {
                return storage_error("creating the image's file", e);
            }
            plane.nbd
        }
        None => SocketAddr::from(([127, 0, 0, 1], 10809)),
    };
    let image = json!({"name": name, "sizeBytes": size, "labels": body["labels"].clone(),
        "nbd": {"host": nbd.ip().to_string(), "port": nbd.port(), "export": name, "tls": tls}});
    images.insert(key, image.clone());
    (StatusCode::CREATED, Json(image)).into_response()
}

async fn get_image(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    s.image_gets.fetch_add(1, Ordering::SeqCst);
    fetch(&s.images, &format!("{pool}/{name}"), "image")
}

async fn patch_image(
    State(s): St,
    Path((pool, name)): Path<(String, String)>,
    Json(body): Json<Value>,
) -> Response {
    let mut images = s.images.lock().unwrap_or_else(|p| p.into_inner());
    let Some(image) = images.get_mut(&format!("{pool}/{name}")) else {
        return error(StatusCode::NOT_FOUND, "NotFound", "no such image");
    };
    if let Some(size) = body["sizeBytes"].as_u64() {
        if size < image["sizeBytes"].as_u64().unwrap_or_default() {
            return error(
                StatusCode::BAD_REQUEST,
                "InvalidArgument",
                "images only grow",
            );
        }
        if let Some(plane) = s.data.get() {
            let grown = std::fs::OpenOptions::new()
                .write(true)
                .open(plane.image(&name))
                .and_then(|f| f.set_len(size));
            if let Err(e) = grown {
                return storage_error("growing the image's file", e);
            }
        }
        image["sizeBytes"] = json!(size);
    }
    if body["labels"].is_object() {
        image["labels"] = body["labels"].clone();
    }
    Json(image.clone()).into_response()
}

async fn delete_image(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    let key = format!("{pool}/{name}");
    let grants = s
        .grants
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&key);
    if let Some(plane) = s.data.get() {
        if s.images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&key)
        {
            let links = grants
                .into_iter()
                .flatten()
                .map(|(_, (_, t))| plane.grant(&name, &t));
            for file in links.chain([plane.image(&name)]) {
                if let Err(e) = remove_if_there(&file) {
                    return storage_error("removing the image's files", e);
                }
            }
        }
    }
    take(&s.images, &key, "image")
}

fn remove_if_there(file: &std::path::Path) -> std::io::Result<()> {
    match std::fs::remove_file(file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// 128 random bits as hex, as the contract's tokens are.
fn new_token() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .unwrap_or_default();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// 404 when there is no image `key`.
fn no_image(s: &Inner, key: &str) -> Option<Response> {
    let images = s.images.lock().unwrap_or_else(|p| p.into_inner());
    (!images.contains_key(key)).then(|| error(StatusCode::NOT_FOUND, "NotFound", "no such image"))
}

async fn put_grant(
    State(s): St,
    Path((pool, name, node)): Path<(String, String, String)>,
    Json(body): Json<Value>,
) -> Response {
    let key = format!("{pool}/{name}");
    if let Some(missing) = no_image(&s, &key) {
        return missing;
    }
    let Some(read_only) = body["readOnly"].as_bool() else {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidArgument",
            "readOnly is required",
        );
    };
    let mut grants = s.grants.lock().unwrap_or_else(|p| p.into_inner());
    let (read_only, token) = grants
        .entry(key)
        .or_default()
        .entry(node.clone())
        .or_insert_with(|| (read_only, new_token()))
        .clone();
    if let Some(plane) = s.data.get() {
        // A repeated PUT finds its link made.
        let link = plane.grant(&name, &token);
        match std::fs::hard_link(plane.image(&name), &link) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return storage_error("linking the grant's export name", e)
            }
            _ => {}
        }
    }
    Json(json!({"node": node, "readOnly": read_only, "token": token})).into_response()
}

async fn delete_grant(
    State(s): St,
    Path((pool, name, node)): Path<(String, String, String)>,
) -> Response {
    let mut grants = s.grants.lock().unwrap_or_else(|p| p.into_inner());
    match grants
        .get_mut(&format!("{pool}/{name}"))
        .and_then(|g| g.remove(&node))
    {
        Some((_, token)) => {
            if let Some(plane) = s.data.get() {
                if let Err(e) = remove_if_there(&plane.grant(&name, &token)) {
                    return storage_error("unlinking the grant's export name", e);
                }
            }
            StatusCode::NO_CONTENT.into_response()
        }
        None => error(StatusCode::NOT_FOUND, "NotFound", "no such grant"),
    }
}

async fn list_grants(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    let key = format!("{pool}/{name}");
    if let Some(missing) = no_image(&s, &key) {
        return missing;
    }
    let grants: Vec<Value> = s
        .grants
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
        .into_iter()
        .flatten()
        .map(|(node, (ro, _))| json!({"node": node, "readOnly": ro}))
        .collect();
    Json(json!({"grants": grants})).into_response()
}

async fn create_snapshot(
    State(s): St,
    Path((pool, image)): Path<(String, String)>,
    Json(body): Json<Value>,
) -> Response {
    let Some(source) = s
        .images
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&format!("{pool}/{image}"))
        .cloned()
    else {
        return error(StatusCode::NOT_FOUND, "NotFound", "no such image");
    };
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let mut snaps = s.snapshots.lock().unwrap_or_else(|p| p.into_inner());
    let key = format!("{pool}/{name}");
    if snaps.contains_key(&key) {
        return error(StatusCode::CONFLICT, "AlreadyExists", "snapshot exists");
    }
    let snap = json!({"name": name, "image": image, "sizeBytes": source["sizeBytes"], "createdAt": "2026-11-29T00:00:00Z"});
    snaps.insert(key, snap.clone());
    (StatusCode::CREATED, Json(snap)).into_response()
}

/// All members or none, under the image and snapshot locks at once: nothing changes an image
/// between two members' snapshots (the fake holds no data, so this is all there is to hold).
async fn create_group(State(s): St, Path(pool): Path<String>, Json(body): Json<Value>) -> Response {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let members = body["members"].as_array().cloned().unwrap_or_default();
    if name.is_empty() || members.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidArgument",
            "name and members are required",
        );
    }
    let images = s.images.lock().unwrap_or_else(|p| p.into_inner());
    let mut snaps = s.snapshots.lock().unwrap_or_else(|p| p.into_inner());
    let mut groups = s.groups.lock().unwrap_or_else(|p| p.into_inner());
    if groups.contains_key(&format!("{pool}/{name}")) {
        return error(StatusCode::CONFLICT, "AlreadyExists", "group exists");
    }
    let mut taken = Vec::new();
    for m in &members {
        let (Some(snapshot), Some(image)) = (m["snapshot"].as_str(), m["image"].as_str()) else {
            return error(
                StatusCode::BAD_REQUEST,
                "InvalidArgument",
                "a member needs snapshot and image",
            );
        };
        let Some(source) = images.get(&format!("{pool}/{image}")) else {
            return error(StatusCode::NOT_FOUND, "NotFound", "no such image");
        };
        if snaps.contains_key(&format!("{pool}/{snapshot}")) {
            return error(StatusCode::CONFLICT, "AlreadyExists", "snapshot exists");
        }
        taken.push((
            format!("{pool}/{snapshot}"),
            json!({"name": snapshot, "image": image, "sizeBytes": source["sizeBytes"],
                   "createdAt": "2026-11-29T00:00:00Z", "group": name}),
        ));
    }
    snaps.extend(taken);
    let group = json!({"name": name, "members": members, "createdAt": "2026-11-29T00:00:00Z"});
    groups.insert(format!("{pool}/{name}"), group.clone());
    (StatusCode::CREATED, Json(group)).into_response()
}

async fn get_group(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    fetch(&s.groups, &format!("{pool}/{name}"), "group")
}

async fn delete_group(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    take(&s.groups, &format!("{pool}/{name}"), "group")
}

async fn list_snapshots(State(s): St, Path(pool): Path<String>) -> Response {
    Json(json!({"snapshots": in_pool(&s.snapshots, &pool)})).into_response()
}

/// The objects of `map` (keyed `<pool>/<name>`) in `pool`.
fn in_pool(map: &Mutex<HashMap<String, Value>>, pool: &str) -> Vec<Value> {
    map.lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{pool}/")))
        .map(|(_, v)| v.clone())
        .collect()
}

async fn get_snapshot(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    fetch(&s.snapshots, &format!("{pool}/{name}"), "snapshot")
}

async fn delete_snapshot(State(s): St, Path((pool, name)): Path<(String, String)>) -> Response {
    take(&s.snapshots, &format!("{pool}/{name}"), "snapshot")
}
