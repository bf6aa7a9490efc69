// Tests of AttachmentTable (server/transfer/attachment_table.h) alone: an
// attachment is found for a caller its owner permits and for no one else
// (null, as for an unknown id); the manager's lookups by id find it for
// anyone; Take removes it and hands it back whole; List gives every
// attachment's info in id order. (TransferManager's Attach and Detach over
// the table: attachments_test.cc.)
#include "server/transfer/attachment_table.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvhost {
namespace {

// An attachment `id` made within `session` ("" for none).
Attachment Made(const std::string& id, const std::string& session, const std::string& pool) {
  Attachment attachment;
  attachment.info.id = id;
  attachment.info.pool = pool;
  attachment.info.session_id = session;
  auto owner = std::make_shared<Owner>();
  owner->session_id = session;
  attachment.owner = std::move(owner);
  return attachment;
}

Caller CallerIn(const std::string& session) {
  Caller caller;
  caller.sessions.push_back(session);
  return caller;
}

TEST(AttachmentTableTest, FoundOnlyForACallerItsOwnerPermits) {
  AttachmentTable table;
  table.Add(Made("att-1", "ses-1", "llama"));
  table.Add(Made("att-2", "", "qwen"));  // no session: whoever holds its id

  Attachment* mine = table.Find(CallerIn("ses-1"), "att-1");
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(mine->info.pool, "llama");
  // Another session and a caller naming none: told nothing, as for an
  // unknown id.
  EXPECT_EQ(table.Find(CallerIn("ses-2"), "att-1"), nullptr);
  EXPECT_EQ(table.Find(Caller{}, "att-1"), nullptr);
  EXPECT_EQ(table.Find(CallerIn("ses-1"), "att-3"), nullptr);
  // An attachment without a session serves anyone.
  EXPECT_NE(table.Find(Caller{}, "att-2"), nullptr);
  EXPECT_NE(table.Find(CallerIn("ses-2"), "att-2"), nullptr);

  const AttachmentTable& read = table;
  ASSERT_NE(read.Find(CallerIn("ses-1"), "att-1"), nullptr);
  EXPECT_EQ(read.Find(CallerIn("ses-1"), "att-1"), mine);
  EXPECT_EQ(read.Find(CallerIn("ses-2"), "att-1"), nullptr);
}

TEST(AttachmentTableTest, TheManagersLookupsByIdAskNoCaller) {
  AttachmentTable table;
  table.Add(Made("att-1", "ses-1", "llama"));
  EXPECT_TRUE(table.Contains("att-1"));
  EXPECT_FALSE(table.Contains("att-2"));
  Attachment* got = table.Get("att-1");
  ASSERT_NE(got, nullptr);
  // What the manager changes through Get stays in the table.
  ++got->worker_copies;
  EXPECT_EQ(table.Find(CallerIn("ses-1"), "att-1")->worker_copies, 1u);
  EXPECT_EQ(table.Get("att-2"), nullptr);
}

TEST(AttachmentTableTest, TakeRemovesTheAttachmentAndHandsItBack) {
  AttachmentTable table;
  table.Add(Made("att-1", "ses-1", "llama"));
  table.Add(Made("att-2", "ses-1", "qwen"));
  std::optional<Attachment> taken = table.Take("att-1");
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->info.id, "att-1");
  EXPECT_EQ(taken->info.pool, "llama");
  ASSERT_NE(taken->owner, nullptr);
  EXPECT_EQ(taken->owner->session_id, "ses-1");
  EXPECT_EQ(table.size(), 1u);
  EXPECT_FALSE(table.Contains("att-1"));
  EXPECT_EQ(table.Find(CallerIn("ses-1"), "att-1"), nullptr);
  // A second take, or one of an unknown id, finds nothing.
  EXPECT_FALSE(table.Take("att-1").has_value());
  EXPECT_FALSE(table.Take("att-9").has_value());
  EXPECT_NE(table.Find(CallerIn("ses-1"), "att-2"), nullptr);
}

TEST(AttachmentTableTest, ListGivesEveryAttachmentsInfoInIdOrder) {
  AttachmentTable table;
  EXPECT_TRUE(table.List().empty());
  table.Add(Made("att-b", "ses-1", "qwen"));
  table.Add(Made("att-a", "", "llama"));
  const std::vector<AttachmentInfo> infos = table.List();
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].id, "att-a");
  EXPECT_EQ(infos[0].pool, "llama");
  EXPECT_EQ(infos[1].id, "att-b");
  EXPECT_EQ(infos[1].session_id, "ses-1");
  EXPECT_EQ(table.size(), 2u);
}

}  // namespace
}  // namespace kvhost
