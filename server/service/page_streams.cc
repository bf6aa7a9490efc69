#include "server/service/page_streams.h"

#include <algorithm>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "server/access/caller.h"
#include "server/service/call_scope.h"
#include "server/service/convert.h"

namespace kvhost {
namespace {

absl::Span<uint8_t> Bytes(std::string* s) {
  return absl::MakeSpan(reinterpret_cast<uint8_t*>(s->data()), s->size());
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// ABORTED naming the pool once it is deleted: what the stream moved since is
// lost with it.
absl::Status CheckNotDeleted(const Pool& pool, const char* rpc, uint64_t pages_done,
                             const char* done_verb) {
  if (!pool.retired()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("pool '", pool.name(), "' was deleted during ", rpc, " (",
                                         pages_done, pages_done == 1 ? " page " : " pages ",
                                         done_verb, " before)"));
}

class PageReader final : public grpc::ServerWriteReactor<v1::PageData> {
 public:
  PageReader(PoolRegistry* registry, const v1::ReadPagesRequest& request, uint64_t chunk_limit,
             absl::StatusOr<std::shared_ptr<Pool>> pool)
      : indices_(pool.ok() ? request.indices().begin() : request.indices().end(),
                 request.indices().end()) {
    absl::Status status =
        pool.ok() ? Start(registry, *std::move(pool), request, chunk_limit) : pool.status();
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    NextWrite();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ReadPages: the client went away"));
      return;
    }
    NextWrite();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Start(PoolRegistry* registry, std::shared_ptr<Pool> pool,
                     const v1::ReadPagesRequest& request, uint64_t chunk_limit) {
    pool_ = std::move(pool);
    std::set<int64_t> seen;
    for (int64_t index : indices_) {
      if (absl::Status s = pool_->CheckPage(index); !s.ok()) return s;
      if (!seen.insert(index).second) {
        return WithPool(pool_->name(), absl::InvalidArgumentError(absl::StrCat(
                                           "ReadPages: page ", index, " is listed twice")));
      }
    }
    page_bytes_ = pool_->flat_page_bytes();
    const uint64_t asked =
        request.chunk_bytes() == 0 ? kDefaultPageChunkBytes : uint64_t{request.chunk_bytes()};
    // No chunk larger than a page: its buffer is all the stream holds.
    chunk_bytes_ = std::max<uint64_t>(1, std::min({asked, chunk_limit, page_bytes_}));
    absl::StatusOr<TransientReservation> buffer =
        registry->ReserveTransient(indices_.empty() ? 0 : chunk_bytes_,
                                   absl::StrCat("ReadPages of pool '", pool_->name(), "'"));
    if (!buffer.ok()) return buffer.status();
    buffer_ = *std::move(buffer);
    return absl::OkStatus();
  }

  // Sends the next chunk, moving to the next page when one is sent;
  // finishes after the last page.
  void NextWrite() {
    if (offset_ >= page_bytes_ && sent_page_) {
      ++next_;
      offset_ = 0;
      sent_page_ = false;
    }
    if (absl::Status s = CheckNotDeleted(*pool_, "ReadPages", next_, "sent"); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    if (next_ >= indices_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const int64_t index = indices_[next_];
    const uint64_t n = std::min<uint64_t>(chunk_bytes_, page_bytes_ - offset_);
    std::string* data = message_.mutable_data();
    data->resize(n);  // within the reserved chunk
    if (absl::Status s = pool_->ReadPageRange(index, offset_, Bytes(data)); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    message_.set_index(index);
    message_.set_offset(offset_);
    message_.set_page_bytes(page_bytes_);
    offset_ += n;
    sent_page_ = true;  // a page of 0 bytes still gets its one message
    StartWrite(&message_);
  }

  const std::vector<int64_t> indices_;
  std::shared_ptr<Pool> pool_;
  uint64_t page_bytes_ = 0;
  uint64_t chunk_bytes_ = 0;
  TransientReservation buffer_;  // message_'s data, counted against --memory-limit
  size_t next_ = 0;              // indices_[next_] is the page being sent
  uint64_t offset_ = 0;          // bytes of it sent
  bool sent_page_ = false;       // a message of it went out
  v1::PageData message_;         // valid until OnWriteDone
};

class PageWriter final : public grpc::ServerReadReactor<v1::WritePagesChunk> {
 public:
  PageWriter(PoolRegistry* registry, v1::WritePagesResponse* response,
             std::optional<std::string> token, uint64_t max_pages,
             std::vector<std::string> sessions, SessionOpen session_open)
      : registry_(registry),
        response_(response),
        token_(std::move(token)),
        max_pages_(max_pages),
        sessions_(std::move(sessions)),
        session_open_(std::move(session_open)) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending (or went away)
      if (pool_ == nullptr) {
        response_->set_pages_written(0);
        Finish(grpc::Status::OK);
        return;
      }
      if (absl::Status s = CheckNotDeleted(*pool_, "WritePages", written_, "written"); !s.ok()) {
        Fail(s);
        return;
      }
      if (in_page_) {
        Fail(absl::InvalidArgumentError(absl::StrCat("the stream ended with page ", index_,
                                                     " incomplete (", offset_, " of ", page_bytes_,
                                                     " bytes)")));
        return;
      }
      response_->set_pages_written(written_);
      Finish(grpc::Status::OK);
      return;
    }
    absl::Status s = Take(chunk_);
    // Drops the chunk's buffer (Clear would keep its capacity): between
    // chunks the stream holds none.
    chunk_ = v1::WritePagesChunk();
    if (!s.ok()) {
      Fail(s);
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take(const v1::WritePagesChunk& chunk) {
    if (pool_ == nullptr) {
      if (chunk.pool().empty()) {
        return absl::InvalidArgumentError("WritePages: the first chunk must name the pool");
      }
      // Resolved once, the token checked on the pool the stream then writes.
      absl::StatusOr<PoolTarget> target = registry_->Resolve(chunk.pool(), TokenOf(token_));
      if (!target.ok()) return target.status();
      if (absl::Status s = RefuseNodeCache(*target->pool); !s.ok()) return s;
      pool_ = std::move(target->pool);
      name_ = chunk.pool();
      page_bytes_ = pool_->flat_page_bytes();
    } else if (!chunk.pool().empty() && chunk.pool() != name_) {
      return absl::InvalidArgumentError(absl::StrCat("WritePages: chunk names pool '", chunk.pool(),
                                                     "' in a stream for pool '", name_, "'"));
    }
    if (absl::Status s = CheckNotDeleted(*pool_, "WritePages", written_, "written"); !s.ok()) {
      return s;
    }
    if (!in_page_) {
      if (absl::Status s =
              CheckIndexCount("WritePages: pages in one stream", pages_started_ + 1, max_pages_);
          !s.ok()) {
        return WithPool(pool_->name(), s);
      }
      if (absl::Status s = pool_->CheckPage(chunk.index()); !s.ok()) return s;
      if (chunk.offset() != 0) {
        return WithPool(pool_->name(), absl::InvalidArgumentError(absl::StrCat(
                                           "WritePages: page ", chunk.index(), " starts at offset ",
                                           chunk.offset(), ", not 0")));
      }
      index_ = chunk.index();
      offset_ = 0;
      in_page_ = true;
      ++pages_started_;
    } else if (chunk.index() != index_ || chunk.offset() != offset_) {
      return WithPool(pool_->name(),
                      absl::InvalidArgumentError(absl::StrCat(
                          "WritePages: got page ", chunk.index(), " offset ", chunk.offset(),
                          " while page ", index_, " needs its bytes from offset ", offset_)));
    }
    const uint64_t n = chunk.data().size();
    if (n > page_bytes_ - offset_) {
      return WithPool(pool_->name(),
                      absl::InvalidArgumentError(absl::StrCat(
                          "WritePages: page ", index_, " chunk at offset ", offset_, " has ", n,
                          " bytes; a page of ", pool_->Label(), " has ", page_bytes_)));
    }
    // The chunk's bytes are held until they are copied: counted meanwhile.
    absl::StatusOr<TransientReservation> held =
        registry_->ReserveTransient(n, absl::StrCat("WritePages of pool '", pool_->name(), "'"));
    if (!held.ok()) return held.status();
    // Each chunk, so that a pool claimed by another instance mid-stream
    // takes no more of this stream's bytes (ClaimPool).
    if (absl::Status s = pool_->ChangeAllocation(
            sessions_, session_open_, "WritePages",
            [&] { return pool_->WritePageRange(index_, offset_, Bytes(chunk.data())); });
        !s.ok()) {
      return s;
    }
    offset_ += n;
    if (offset_ < page_bytes_) return absl::OkStatus();
    in_page_ = false;
    ++written_;
    return absl::OkStatus();
  }

  void Fail(const absl::Status& status) {
    if (pool_ == nullptr) {  // nothing could have been written
      Finish(ToGrpcStatus(status));
      return;
    }
    std::string partial;
    if (in_page_ && offset_ > 0) {
      partial = absl::StrCat("; page ", index_, " has its first ", offset_, " bytes written");
    }
    Finish(ToGrpcStatus(absl::Status(
        status.code(),
        absl::StrCat(status.message(), " (", written_, written_ == 1 ? " page" : " pages",
                     " written before this error stay written", partial, ")"))));
  }

  PoolRegistry* const registry_;
  v1::WritePagesResponse* const response_;
  const std::optional<std::string> token_;
  const uint64_t max_pages_;
  const std::vector<std::string> sessions_;  // the caller's worker sessions
  const SessionOpen session_open_;
  uint64_t pages_started_ = 0;
  v1::WritePagesChunk chunk_;
  std::shared_ptr<Pool> pool_;
  std::string name_;  // as the first chunk named it (a pool, or a group for its anchor)
  uint64_t page_bytes_ = 0;
  bool in_page_ = false;
  int64_t index_ = 0;
  uint64_t offset_ = 0;
  uint64_t written_ = 0;
};

}  // namespace

grpc::ServerWriteReactor<v1::PageData>* NewPageReader(PoolRegistry* registry,
                                                      const v1::ReadPagesRequest& request,
                                                      uint64_t chunk_limit,
                                                      absl::StatusOr<std::shared_ptr<Pool>> pool) {
  return new PageReader(registry, request, chunk_limit, std::move(pool));
}

grpc::ServerReadReactor<v1::WritePagesChunk>* NewPageWriter(
    PoolRegistry* registry, v1::WritePagesResponse* response, std::optional<std::string> token,
    uint64_t max_pages, std::vector<std::string> sessions, SessionOpen session_open) {
  return new PageWriter(registry, response, std::move(token), max_pages, std::move(sessions),
                        std::move(session_open));
}

}  // namespace kvhost
