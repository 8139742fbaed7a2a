//! The etcd v3 gRPC calls the etcd driver makes, and nothing else: the messages are written out
//! here with `prost`'s derive (field numbers from etcd's `rpc.proto` and `kv.proto`), so building
//! Leasehold needs no `protoc`, no well-known `.proto` files and no build script. Fields the
//! driver never reads are left out; protobuf skips unknown fields, so etcd's answers still
//! decode. The conformance suite runs every call here against a real etcd.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use http::uri::PathAndQuery;
use tonic::client::Grpc;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Request, Status};
use tonic_prost::ProstCodec;

use crate::drivers::replaceable::{Outgoing, Replaceable};

/// etcd's `ResponseHeader`: only the revision is used.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHeader {
    #[prost(int64, tag = "3")]
    pub revision: i64,
}

/// `mvccpb.KeyValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub create_revision: i64,
    #[prost(int64, tag = "3")]
    pub mod_revision: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "6")]
    pub lease: i64,
}

/// `RangeRequest.SortOrder`.
pub const SORT_ASCEND: i32 = 1;
pub const SORT_DESCEND: i32 = 2;
/// `RangeRequest.SortTarget`: by create revision.
pub const SORT_BY_CREATE: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub limit: i64,
    #[prost(int32, tag = "5")]
    pub sort_order: i32,
    #[prost(int32, tag = "6")]
    pub sort_target: i32,
    #[prost(bool, tag = "8")]
    pub keys_only: bool,
    #[prost(int64, tag = "13")]
    pub max_create_revision: i64,
}

impl RangeRequest {
    /// Every key that starts with `prefix`.
    pub fn prefix(prefix: &str) -> Self {
        Self {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix.as_bytes()),
            ..Self::default()
        }
    }

    /// One key.
    pub fn key(key: &str) -> Self {
        Self {
            key: key.as_bytes().to_vec(),
            ..Self::default()
        }
    }

    /// The first key by create revision (`SORT_ASCEND`) or the last (`SORT_DESCEND`).
    pub fn first_by_create(mut self, order: i32) -> Self {
        self.sort_target = SORT_BY_CREATE;
        self.sort_order = order;
        self.limit = 1;
        self
    }
}

/// The end of the range of keys starting with `prefix`: the prefix with its last byte below
/// 0xff raised by one, as etcd's clients compute it.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from `prefix` on.
    vec![0]
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub lease: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

/// A delete of `key` alone (an empty `range_end`), in a transaction or on its own.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeleteRangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
    #[prost(bool, tag = "3")]
    pub prev_kv: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DeleteRangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "3")]
    pub prev_kvs: Vec<KeyValue>,
}

/// `RequestOp`: the reads, puts and deletes a transaction makes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RequestOp {
    #[prost(oneof = "Op", tags = "1, 2, 3")]
    pub request: Option<Op>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Op {
    #[prost(message, tag = "1")]
    Range(RangeRequest),
    #[prost(message, tag = "2")]
    Put(PutRequest),
    #[prost(message, tag = "3")]
    DeleteRange(DeleteRangeRequest),
}

impl From<DeleteRangeRequest> for RequestOp {
    fn from(delete: DeleteRangeRequest) -> Self {
        Self {
            request: Some(Op::DeleteRange(delete)),
        }
    }
}

impl From<RangeRequest> for RequestOp {
    fn from(range: RangeRequest) -> Self {
        Self {
            request: Some(Op::Range(range)),
        }
    }
}

impl From<PutRequest> for RequestOp {
    fn from(put: PutRequest) -> Self {
        Self {
            request: Some(Op::Put(put)),
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseOp {
    #[prost(oneof = "OpResponse", tags = "1, 2, 3")]
    pub response: Option<OpResponse>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum OpResponse {
    #[prost(message, tag = "1")]
    Range(RangeResponse),
    #[prost(message, tag = "2")]
    Put(PutResponse),
    #[prost(message, tag = "3")]
    DeleteRange(DeleteRangeResponse),
}

/// `Compare.CompareResult::EQUAL` and `Compare.CompareTarget::CREATE`.
const COMPARE_EQUAL: i32 = 0;
const COMPARE_CREATE: i32 = 1;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Compare {
    #[prost(int32, tag = "1")]
    pub result: i32,
    #[prost(int32, tag = "2")]
    pub target: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub key: Vec<u8>,
    #[prost(oneof = "CompareWith", tags = "5")]
    pub target_union: Option<CompareWith>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum CompareWith {
    #[prost(int64, tag = "5")]
    CreateRevision(i64),
}

impl Compare {
    /// `key` exists and was created at `revision`: the same key, not one put again since.
    pub fn created_at(key: &str, revision: i64) -> Self {
        Self {
            result: COMPARE_EQUAL,
            target: COMPARE_CREATE,
            key: key.as_bytes().to_vec(),
            target_union: Some(CompareWith::CreateRevision(revision)),
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    pub compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    pub success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    pub failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TxnResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(bool, tag = "2")]
    pub succeeded: bool,
    #[prost(message, repeated, tag = "3")]
    pub responses: Vec<ResponseOp>,
}

impl TxnResponse {
    /// The reads' answers, in the order they were asked.
    pub fn ranges(self) -> Vec<RangeResponse> {
        self.responses
            .into_iter()
            .filter_map(|r| match r.response {
                Some(OpResponse::Range(range)) => Some(range),
                _ => None,
            })
            .collect()
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(oneof = "WatchRequestUnion", tags = "1")]
    pub request_union: Option<WatchRequestUnion>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum WatchRequestUnion {
    #[prost(message, tag = "1")]
    Create(WatchCreateRequest),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchCreateRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub start_revision: i64,
}

/// `mvccpb.Event.EventType::DELETE`.
pub const EVENT_DELETE: i32 = 1;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(int32, tag = "1")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchResponse {
    #[prost(bool, tag = "4")]
    pub canceled: bool,
    #[prost(int64, tag = "5")]
    pub compact_revision: i64,
    #[prost(string, tag = "6")]
    pub cancel_reason: String,
    #[prost(message, repeated, tag = "11")]
    pub events: Vec<Event>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantRequest {
    #[prost(int64, tag = "1")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

/// `LeaseRevokeRequest` and `LeaseKeepAliveRequest` alike: a lease ID.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseId {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseRevokeResponse {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveResponse {
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseTimeToLiveRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseTimeToLiveResponse {
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(int64, tag = "4")]
    pub granted_ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StatusRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StatusResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthenticateRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub password: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthenticateResponse {
    #[prost(string, tag = "2")]
    pub token: String,
}

/// How to reach the cluster: `host:port` endpoints, and TLS when the members serve it.
pub struct Connect<'a> {
    pub endpoints: &'a [String],
    pub tls: Option<TlsPem>,
    pub user: Option<(String, String)>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

/// PEM text: the CA, and a client certificate and key for members that ask for one.
pub struct TlsPem {
    pub ca: String,
    pub client: Option<(String, String)>,
}

/// Why a call failed: the transport (with its causes, e.g. "invalid peer certificate"), or
/// etcd's answer.
#[derive(Debug)]
pub enum RpcError {
    Unreachable(String),
    Status(Status),
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RpcError::Unreachable(text) => f.write_str(text),
            RpcError::Status(status) => write!(f, "{}: {}", status.code(), status.message()),
        }
    }
}

impl From<Status> for RpcError {
    fn from(status: Status) -> Self {
        if matches!(
            status.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled
        ) {
            RpcError::Unreachable(with_causes(&status))
        } else {
            RpcError::Status(status)
        }
    }
}

/// An error's text followed by its causes', so that the root (a refused connection, an unknown
/// certificate issuer) is never hidden behind "transport error".
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.contains(&next) {
            text = format!("{text}: {next}");
        }
        cause = c.source();
    }
    text
}

pub type RpcResult<T> = std::result::Result<T, RpcError>;

/// Tell `call`'s channel how the call ended: the client's own timeout (a cancelled call) means
/// the members left it unanswered.
fn ended<T>(call: Outgoing<'_, Channel>, reply: &std::result::Result<T, Status>) {
    match reply {
        Err(status) if matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded) => {
            call.timed_out()
        }
        _ => call.answered(),
    }
}

/// A connected etcd client: cheap to clone (one HTTP/2 channel underneath, replaced once the
/// members fall silent on it: [`Replaceable`]).
#[derive(Clone)]
pub struct EtcdClient {
    channels: Arc<Replaceable<Channel>>,
    user: Option<Arc<(String, String)>>,
    token: Arc<RwLock<Option<MetadataValue<tonic::metadata::Ascii>>>>,
}

impl EtcdClient {
    /// Connects to the one endpoint at once (so a refused connection or a bad certificate shows
    /// now, with its cause), or spreads over several lazily; then logs in when a user is set.
    pub async fn connect(options: Connect<'_>) -> RpcResult<Self> {
        let scheme = if options.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let tls = match &options.tls {
            Some(pem) => {
                let mut config =
                    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&pem.ca));
                if let Some((cert, key)) = &pem.client {
                    config = config.identity(Identity::from_pem(cert, key));
                }
                Some(config)
            }
            None => None,
        };
        let mut endpoints = Vec::with_capacity(options.endpoints.len());
        for host in options.endpoints {
            // `host:port`; a URL with its own scheme is taken as it is.
            let uri = if host.contains("://") {
                host.clone()
            } else {
                format!("{scheme}://{host}")
            };
            let mut endpoint = Endpoint::from_shared(uri)
                .map_err(|e| RpcError::Unreachable(format!("endpoint {host}: {e}")))?
                .connect_timeout(options.connect_timeout)
                .timeout(options.request_timeout)
                .tcp_nodelay(true);
            if let Some(tls) = &tls {
                endpoint = endpoint
                    .tls_config(tls.clone())
                    .map_err(|e| RpcError::Unreachable(with_causes(&e)))?;
            }
            endpoints.push(endpoint);
        }
        let channel = match endpoints.as_slice() {
            [one] => one
                .connect()
                .await
                .map_err(|e| RpcError::Unreachable(with_causes(&e)))?,
            _ => Channel::balance_list(endpoints.clone().into_iter()),
        };
        // A replacement connects on its first call, which says why if it cannot.
        let another = move || {
            Ok(match endpoints.as_slice() {
                [one] => one.connect_lazy(),
                _ => Channel::balance_list(endpoints.clone().into_iter()),
            })
        };
        let client = Self {
            channels: Arc::new(Replaceable::new(
                channel,
                options.request_timeout,
                "etcd",
                another,
            )),
            user: options.user.map(Arc::new),
            token: Arc::new(RwLock::new(None)),
        };
        client.authenticate().await?;
        Ok(client)
    }

    async fn authenticate(&self) -> RpcResult<()> {
        let Some(user) = &self.user else {
            return Ok(());
        };
        let reply: AuthenticateResponse = self
            .raw_unary(
                "/etcdserverpb.Auth/Authenticate",
                AuthenticateRequest {
                    name: user.0.clone(),
                    password: user.1.clone(),
                },
                None,
            )
            .await?;
        let token = MetadataValue::try_from(reply.token.as_str()).map_err(|e| {
            RpcError::Status(Status::internal(format!("etcd auth token unusable: {e}")))
        })?;
        *self.token.write().unwrap_or_else(|e| e.into_inner()) = Some(token);
        Ok(())
    }

    fn current_token(&self) -> Option<MetadataValue<tonic::metadata::Ascii>> {
        self.token.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn request<M>(message: M, token: Option<MetadataValue<tonic::metadata::Ascii>>) -> Request<M> {
        let mut request = Request::new(message);
        if let Some(token) = token {
            request.metadata_mut().insert("token", token);
        }
        request
    }

    async fn raw_unary<Req, Resp>(
        &self,
        path: &'static str,
        message: Req,
        token: Option<MetadataValue<tonic::metadata::Ascii>>,
    ) -> RpcResult<Resp>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let call = self.channels.outgoing();
        let mut grpc = Grpc::new(call.connection.clone());
        if let Err(e) = grpc.ready().await {
            // Not a silence: the channel itself reconnects after a failed connection.
            call.answered();
            return Err(RpcError::Unreachable(with_causes(&e)));
        }
        let reply = grpc
            .unary(
                Self::request(message, token),
                PathAndQuery::from_static(path),
                ProstCodec::<Req, Resp>::default(),
            )
            .await;
        ended(call, &reply);
        Ok(reply?.into_inner())
    }

    /// One call; an expired auth token (etcd's simple tokens last minutes) is renewed once.
    async fn unary<Req, Resp>(&self, path: &'static str, message: Req) -> RpcResult<Resp>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        match self
            .raw_unary(path, message.clone(), self.current_token())
            .await
        {
            Err(RpcError::Status(status)) if self.user.is_some() && token_expired(&status) => {
                self.authenticate().await?;
                self.raw_unary(path, message, self.current_token()).await
            }
            other => other,
        }
    }

    /// A bidirectional stream with `first` as its only message, whose sending side stays open
    /// until the answer is dropped ([`OpenStream`]).
    async fn open_stream<Req, Resp>(
        &self,
        path: &'static str,
        first: Req,
    ) -> RpcResult<OpenStream<Resp>>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let open = |token| {
            let call = self.channels.outgoing();
            let mut grpc = Grpc::new(call.connection.clone());
            let (close, closed) = tokio::sync::oneshot::channel::<()>();
            // Ends (without a message) once `close` is dropped with the answer.
            let end = futures_util::stream::once(closed).filter_map(|_| async { None });
            let stream = futures_util::stream::iter([first.clone()]).chain(end);
            async move {
                if let Err(e) = grpc.ready().await {
                    call.answered();
                    return Err(RpcError::Unreachable(with_causes(&e)));
                }
                let reply = grpc
                    .streaming(
                        Self::request(stream, token),
                        PathAndQuery::from_static(path),
                        ProstCodec::<Req, Resp>::default(),
                    )
                    .await;
                ended(call, &reply);
                Ok::<_, RpcError>(OpenStream {
                    replies: reply?.into_inner(),
                    _close: close,
                })
            }
        };
        match open(self.current_token()).await {
            Err(RpcError::Status(status)) if self.user.is_some() && token_expired(&status) => {
                self.authenticate().await?;
                open(self.current_token()).await
            }
            other => other,
        }
    }

    pub async fn range(&self, request: RangeRequest) -> RpcResult<RangeResponse> {
        self.unary("/etcdserverpb.KV/Range", request).await
    }

    pub async fn put(&self, request: PutRequest) -> RpcResult<PutResponse> {
        self.unary("/etcdserverpb.KV/Put", request).await
    }

    pub async fn delete_range(
        &self,
        request: DeleteRangeRequest,
    ) -> RpcResult<DeleteRangeResponse> {
        self.unary("/etcdserverpb.KV/DeleteRange", request).await
    }

    pub async fn txn(&self, request: TxnRequest) -> RpcResult<TxnResponse> {
        self.unary("/etcdserverpb.KV/Txn", request).await
    }

    pub async fn lease_grant(&self, ttl: i64) -> RpcResult<LeaseGrantResponse> {
        self.unary("/etcdserverpb.Lease/LeaseGrant", LeaseGrantRequest { ttl })
            .await
    }

    pub async fn lease_revoke(&self, id: i64) -> RpcResult<()> {
        let _: LeaseRevokeResponse = self
            .unary("/etcdserverpb.Lease/LeaseRevoke", LeaseId { id })
            .await?;
        Ok(())
    }

    /// One keep-alive round trip: the lease's TTL after it, or `None` when the lease is gone.
    pub async fn lease_keep_alive(&self, id: i64) -> RpcResult<Option<i64>> {
        let mut stream: OpenStream<LeaseKeepAliveResponse> = self
            .open_stream("/etcdserverpb.Lease/LeaseKeepAlive", LeaseId { id })
            .await?;
        match stream.message().await? {
            Some(reply) if reply.ttl > 0 => Ok(Some(reply.ttl)),
            Some(_) => Ok(None),
            None => Err(RpcError::Unreachable(
                "etcd closed the keep-alive stream without an answer".into(),
            )),
        }
    }

    pub async fn lease_time_to_live(&self, id: i64) -> RpcResult<LeaseTimeToLiveResponse> {
        self.unary(
            "/etcdserverpb.Lease/LeaseTimeToLive",
            LeaseTimeToLiveRequest { id },
        )
        .await
    }

    /// Events on `key` from `start_revision` on.
    pub async fn watch(
        &self,
        key: Vec<u8>,
        start_revision: i64,
    ) -> RpcResult<OpenStream<WatchResponse>> {
        self.open_stream(
            "/etcdserverpb.Watch/Watch",
            WatchRequest {
                request_union: Some(WatchRequestUnion::Create(WatchCreateRequest {
                    key,
                    start_revision,
                })),
            },
        )
        .await
    }

    pub async fn status(&self) -> RpcResult<StatusResponse> {
        self.unary("/etcdserverpb.Maintenance/Status", StatusRequest {})
            .await
    }
}

/// The answers of a stream opened by [`EtcdClient::open_stream`]. Dropping it ends the stream's
/// sending side, and etcd then ends the stream (`etcd_scenarios.rs`,
/// `renewals_and_watches_leave_no_stream_open`). The sending side used to stay open for good:
/// dropping the answers alone leaves the HTTP/2 stream open at both ends, so every renewal's
/// keep-alive left a stream behind, about 9 KB in the sidecar and the stream's state in etcd,
/// without end. It is not closed at once either, since etcd ends a stream whose client has
/// stopped sending: a watch would end before it reports anything.
pub struct OpenStream<Resp> {
    replies: tonic::Streaming<Resp>,
    _close: tokio::sync::oneshot::Sender<()>,
}

impl<Resp> OpenStream<Resp> {
    pub async fn message(&mut self) -> Result<Option<Resp>, Status> {
        self.replies.message().await
    }
}

/// etcd's answers to a request with a token it no longer knows.
fn token_expired(status: &Status) -> bool {
    status.code() == Code::Unauthenticated || status.message().contains("invalid auth token")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"a/b/"), b"a/b0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn messages_round_trip() {
        use prost::Message;
        let txn = TxnRequest {
            compare: vec![Compare::created_at("k", 7)],
            success: vec![
                RangeRequest::prefix("q/")
                    .first_by_create(SORT_ASCEND)
                    .into(),
            ],
            failure: vec![],
        };
        let bytes = txn.encode_to_vec();
        assert_eq!(TxnRequest::decode(bytes.as_slice()).unwrap(), txn);
    }
}
