//! A route's REST→gRPC transcoding: the protobuf descriptors of its service (compiled
//! by `posternctl` from the team's `.proto` sources, or a descriptor set it was given)
//! and the service's name. The HTTP bindings are the methods' `google.api.http`
//! annotations, read from the descriptors by the node when it builds the snapshot.

use serde::{Deserialize, Serialize};

/// What a transcoded route calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transcode {
    /// Where it came from: `teams/orders/proto/orders.proto`.
    pub source: String,
    /// A `google.protobuf.FileDescriptorSet` with every import, options kept (base64).
    #[serde(with = "base64_bytes")]
    pub descriptors: Vec<u8>,
    /// The fully qualified service: `orders.v1.Orders`.
    pub service: String,
}

mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}
