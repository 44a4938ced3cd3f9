// Following a background job (retrieval ingestion or training) until it ends: the job's
// SSE stream when the service offers one, else polling its JSON state.
import { api, sse } from "./api";

export type JobState = Record<string, unknown>;

const DONE = new Set(["succeeded", "success", "done", "completed", "complete", "finished"]);
const FAILED = new Set(["failed", "failure", "error", "cancelled", "canceled", "revoked"]);

export function jobStatus(job: JobState): string {
  return String(job.status ?? job.state ?? "").toLowerCase();
}

export function isTerminal(job: JobState): boolean {
  const s = jobStatus(job);
  return DONE.has(s) || FAILED.has(s);
}

export function isSuccess(job: JobState): boolean {
  return DONE.has(jobStatus(job));
}

/** (done, total) out of the shapes progress takes: {progress: {done|step, total}} or flat fields. */
export function progressOf(job: JobState): { done: number; total: number } | null {
  const p = (job.progress ?? job) as Record<string, unknown>;
  if (typeof job.progress === "number") return { done: job.progress, total: 1 };
  const done = Number(p.done ?? p.step ?? p.chunks_done ?? p.current ?? NaN);
  const total = Number(p.total ?? p.total_steps ?? p.chunks_total ?? NaN);
  if (Number.isFinite(done) && Number.isFinite(total) && total > 0) return { done, total };
  return null;
}

export interface Follow {
  stop: () => void;
}

/**
 * Calls onUpdate with the job's state until it is terminal. Uses SSE (each event's JSON
 * data, when it carries a status, is the state; otherwise the event triggers a re-read)
 * and falls back to polling when the stream is missing or drops.
 */
export function followJob(
  jobUrl: string,
  eventsUrl: string | null,
  onUpdate: (job: JobState) => void,
  pollMs = 1000,
): Follow {
  let stopped = false;
  const ctrl = new AbortController();
  let last: JobState | null = null;

  const emit = (job: JobState) => {
    if (stopped) return;
    last = job;
    onUpdate(job);
  };

  const reread = async () => {
    const job = await api<JobState>(jobUrl, { signal: ctrl.signal });
    emit(job);
    return job;
  };

  async function viaSse(): Promise<boolean> {
    if (!eventsUrl) return false;
    try {
      for await (const ev of sse(eventsUrl, { signal: ctrl.signal })) {
        if (stopped) return true;
        let data: JobState | null = null;
        try {
          data = JSON.parse(ev.data);
        } catch {
          data = null;
        }
        if (data && typeof data === "object" && (data.status || data.state)) {
          emit({ ...(last ?? {}), ...data });
        } else {
          await reread();
        }
        if (last && isTerminal(last)) return true;
      }
    } catch {
      /* stream unavailable or dropped: poll instead */
    }
    return false;
  }

  async function poll(): Promise<void> {
    while (!stopped) {
      try {
        const job = await reread();
        if (isTerminal(job)) return;
      } catch (exc) {
        if ((exc as Error).name === "AbortError") return;
      }
      await new Promise((r) => setTimeout(r, pollMs));
    }
  }

  void (async () => {
    try {
      await reread();
    } catch {
      /* the first read may race the job's creation; polling retries */
    }
    if (last && isTerminal(last)) return;
    const ended = await viaSse();
    // Re-read once after the stream: its last event may not hold the whole final state.
    if (!stopped && ended) {
      try {
        await reread();
      } catch {
        /* keep what the stream said */
      }
      return;
    }
    await poll();
  })();

  return {
    stop() {
      stopped = true;
      ctrl.abort();
    },
  };
}
