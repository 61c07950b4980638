// Who a process is in a job, from `loom run`'s, mpirun's or srun's variables.
#include "loom/comm/job_env.h"
#include "loom/core/keyed_hash.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "loom/error.h"

namespace loom::comm {
namespace {

using Env = std::map<std::string, std::string>;
using ::testing::HasSubstr;

std::string error_of(const Env& env) {
  try {
    read_job_env(env);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(JobEnv, NoLauncherIsAOneRankJob) {
  auto job = read_job_env(Env{});
  EXPECT_EQ(job.launcher, Launcher::kNone);
  EXPECT_EQ(job.rank, 0);
  EXPECT_EQ(job.world_size, 1);
  EXPECT_FALSE(job.job_id.empty());
}

TEST(JobEnv, LoomRunVariables) {
  auto job = read_job_env(Env{{"LOOM_RANK", "5"},
                              {"LOOM_WORLD_SIZE", "8"},
                              {"LOOM_LOCAL_RANK", "1"},
                              {"LOOM_LOCAL_WORLD_SIZE", "4"},
                              {"LOOM_MASTER_ADDR", "10.0.0.1"},
                              {"LOOM_MASTER_PORT", "29500"},
                              {"LOOM_JOB_SECRET", "abcdef0123456789abcdef"},
                              {"LOOM_NODE_ID", "1"}});
  EXPECT_EQ(job.launcher, Launcher::kLoom);
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.world_size, 8);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.local_world_size, 4);
  EXPECT_EQ(job.master_addr, "10.0.0.1");
  EXPECT_EQ(job.master_port, 29500);
  EXPECT_EQ(job.forced_node_id, 1);
  // Derived from the secret by a keyed hash: unique per job, and no part of the secret.
  EXPECT_EQ(job.job_id, loom::comm::job_id_from_secret("abcdef0123456789abcdef"));
  EXPECT_EQ(job.job_id.size(), 12u);
  EXPECT_EQ(std::string("abcdef0123456789abcdef").find(job.job_id.substr(0, 4)), std::string::npos);
}

TEST(JobEnv, AnyByteStringIsASecretAndTheIdTellsNothingAboutIt) {
  for (std::string secret : {std::string("s3cret with spaces/and slashes"), std::string("\xff\x01\x7f'\"$(x)"),
                             std::string(5000, 'a'), std::string("x")}) {
    const std::string id = loom::comm::job_id_from_secret(secret);
    EXPECT_EQ(id.size(), 12u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
    EXPECT_EQ(id, loom::comm::job_id_from_secret(secret));  // every rank derives the same
    // A job started with it reads the same id (it names the shared memory on every rank).
    auto job = read_job_env(Env{{"LOOM_RANK", "0"}, {"LOOM_WORLD_SIZE", "2"}, {"LOOM_MASTER_PORT", "29500"},
                                {"LOOM_JOB_SECRET", secret}});
    EXPECT_EQ(job.job_id, id);
  }
  EXPECT_NE(loom::comm::job_id_from_secret("a"), loom::comm::job_id_from_secret("b"));
  // HMAC-SHA256 known answer (RFC 4231, test case 2), so the id is the standard construction.
  EXPECT_EQ(loom::hmac_sha256_hex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(JobEnv, MpirunVariablesNeedNoSecret) {
  // Rank 0 makes the secret and broadcasts it over MPI.
  auto job = read_job_env(Env{{"OMPI_COMM_WORLD_RANK", "2"},
                              {"OMPI_COMM_WORLD_SIZE", "4"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(job.launcher, Launcher::kMpi);
  EXPECT_EQ(job.rank, 2);
  EXPECT_EQ(job.world_size, 4);
  EXPECT_EQ(job.local_world_size, 2);
  EXPECT_TRUE(job.secret.empty());
}

TEST(JobEnv, SlurmCompressedTasksPerNode) {
  Env env{{"SLURM_PROCID", "9"},      {"SLURM_NTASKS", "11"},           {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "2"},      {"SLURM_TASKS_PER_NODE", "4(x2),3"}, {"LOOM_MASTER_ADDR", "n0"},
          {"LOOM_MASTER_PORT", "29500"}, {"LOOM_JOB_SECRET", "s3cret-of-the-job"}};
  auto job = read_job_env(env);
  EXPECT_EQ(job.launcher, Launcher::kSlurm);
  EXPECT_EQ(job.rank, 9);
  EXPECT_EQ(job.local_world_size, 3);  // node 2 is the "3" after two nodes of 4
  env["SLURM_NODEID"] = "0";
  EXPECT_EQ(read_job_env(env).local_world_size, 4);
  env["SLURM_TASKS_PER_NODE"] = "4(x2";
  EXPECT_THAT(error_of(env), HasSubstr("SLURM_TASKS_PER_NODE"));
}

TEST(JobEnv, LoomVariablesWinOverMpirunOnes) {
  auto job = read_job_env(Env{{"LOOM_RANK", "0"},
                              {"LOOM_WORLD_SIZE", "1"},
                              {"OMPI_COMM_WORLD_RANK", "3"},
                              {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_EQ(job.launcher, Launcher::kLoom);
  EXPECT_EQ(job.world_size, 1);
}

TEST(JobEnv, MalformedOrInconsistentValuesNameTheVariable) {
  const Env base{{"LOOM_RANK", "0"},
                 {"LOOM_WORLD_SIZE", "2"},
                 {"LOOM_MASTER_PORT", "29500"},
                 {"LOOM_JOB_SECRET", "abcdef0123456789"}};
  auto with = [&](const std::string& k, const std::string& v) {
    Env e = base;
    e[k] = v;
    return error_of(e);
  };
  EXPECT_THAT(with("LOOM_RANK", "two"), HasSubstr("LOOM_RANK"));
  EXPECT_THAT(with("LOOM_RANK", "2"), HasSubstr("below the world size"));
  EXPECT_THAT(with("LOOM_MASTER_PORT", "99999"), HasSubstr("LOOM_MASTER_PORT"));
  EXPECT_THAT(with("LOOM_JOB_ID", "bad/id"), HasSubstr("LOOM_JOB_ID"));
  EXPECT_THAT(with("LOOM_MASTER_ADDR", ""), HasSubstr("LOOM_MASTER_ADDR"));
  Env no_secret = base;
  no_secret.erase("LOOM_JOB_SECRET");
  EXPECT_THAT(error_of(no_secret), HasSubstr("LOOM_JOB_SECRET"));
  Env no_size = base;
  no_size.erase("LOOM_WORLD_SIZE");
  EXPECT_THAT(error_of(no_size), HasSubstr("LOOM_WORLD_SIZE"));
}

}  // namespace
}  // namespace loom::comm
