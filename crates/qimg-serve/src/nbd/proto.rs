//! The numbers of the NBD protocol (all big-endian on the wire), as the specification
//! (`doc/proto.md` of the NBD project) names them.

/// First magic of the handshake, "NBDMAGIC".
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// Second magic of the newstyle handshake and of every option, "IHAVEOPT".
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of an option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server may omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client wants no zero padding.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// `NBD_OPT_EXPORT_NAME`.
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_STARTTLS`.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// `NBD_OPT_EXTENDED_HEADERS`.
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`.
pub const REP_INFO: u32 = 3;
/// `NBD_REP_META_CONTEXT`.
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
/// `NBD_REP_ERR_UNSUP`.
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
/// `NBD_REP_ERR_POLICY`.
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
/// `NBD_REP_ERR_INVALID`.
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
/// `NBD_REP_ERR_TLS_REQD`.
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
/// `NBD_REP_ERR_UNKNOWN`.
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
/// `NBD_REP_ERR_TOO_BIG`.
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

/// `NBD_INFO_EXPORT`.
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`.
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag `NBD_FLAG_HAS_FLAGS`.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag `NBD_FLAG_READ_ONLY`.
pub const TF_READ_ONLY: u16 = 1 << 1;
/// Transmission flag `NBD_FLAG_SEND_FLUSH`.
pub const TF_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag `NBD_FLAG_SEND_FUA`.
pub const TF_SEND_FUA: u16 = 1 << 3;
/// Transmission flag `NBD_FLAG_SEND_TRIM`.
pub const TF_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag `NBD_FLAG_SEND_WRITE_ZEROES`.
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag `NBD_FLAG_SEND_DF`.
pub const TF_SEND_DF: u16 = 1 << 7;
/// Transmission flag `NBD_FLAG_CAN_MULTI_CONN`.
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag `NBD_FLAG_SEND_CACHE`.
pub const TF_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag `NBD_FLAG_SEND_FAST_ZERO`.
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

/// Magic of a (compact) request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended request (after `NBD_OPT_EXTENDED_HEADERS`).
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of an extended reply chunk.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE`.
pub const CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag `NBD_CMD_FLAG_FUA`.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag `NBD_CMD_FLAG_NO_HOLE`.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag `NBD_CMD_FLAG_DF`.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag `NBD_CMD_FLAG_REQ_ONE`.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag `NBD_CMD_FLAG_FAST_ZERO`.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Command flag `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers: `length` is a payload).
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

/// Structured reply flag `NBD_REPLY_FLAG_DONE`.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// `NBD_REPLY_TYPE_NONE`.
pub const REPLY_TYPE_NONE: u16 = 0;
/// `NBD_REPLY_TYPE_OFFSET_DATA`.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// `NBD_REPLY_TYPE_OFFSET_HOLE`.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// `NBD_REPLY_TYPE_BLOCK_STATUS`.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` (extended headers).
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// `NBD_REPLY_TYPE_ERROR`.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// `NBD_STATE_HOLE` of `base:allocation`.
pub const STATE_HOLE: u32 = 1 << 0;
/// `NBD_STATE_ZERO` of `base:allocation`.
pub const STATE_ZERO: u32 = 1 << 1;

/// `EPERM`.
pub const EPERM: u32 = 1;
/// `EIO`.
pub const EIO: u32 = 5;
/// `ENOMEM`.
pub const ENOMEM: u32 = 12;
/// `EINVAL`.
pub const EINVAL: u32 = 22;
/// `ENOSPC`.
pub const ENOSPC: u32 = 28;
/// `EOVERFLOW`.
pub const EOVERFLOW: u32 = 75;
/// `ENOTSUP`.
pub const ENOTSUP: u32 = 95;
/// `ESHUTDOWN`.
pub const ESHUTDOWN: u32 = 108;

/// The longest string (export name, description, context query) the server accepts.
pub const MAX_STRING: usize = 4096;
/// The largest READ or WRITE payload, advertised as the maximum block size.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// The largest option data the server reads; longer options get `NBD_REP_ERR_TOO_BIG`
/// and the connection is closed (skipping unbounded data would let a client keep the server
/// busy forever).
pub const MAX_OPTION: u32 = 64 << 10;
/// Names of the metadata contexts and the ids the server gives them.
pub const CTX_BASE_ALLOCATION: &str = "base:allocation";
/// The `qemu:allocation-depth` context name.
pub const CTX_ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
/// Context id of `base:allocation`.
pub const CTX_ID_BASE: u32 = 1;
/// Context id of `qemu:allocation-depth`.
pub const CTX_ID_DEPTH: u32 = 2;
/// What a `qemu:dirty-bitmap:NAME` context name starts with.
pub const CTX_DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// Context id of the export's first bitmap (the next ones follow).
pub const CTX_ID_BITMAP: u32 = 3;
