/* delayq: hold every packet of one NFQUEUE for a fixed delay, then accept it (a FIFO is the timer queue).
 *
 *   delayq QUEUE_NUMBER DELAY_MICROSECONDS
 *
 * The delay is the same for every packet, so packets fall due in the order they
 * arrive: a ring of (packet id, due time) pairs is the whole timer queue. One
 * poll() loop reads queued packets and issues the verdicts that have fallen due.
 * Prints "ready" on stdout once bound to the queue; exits on SIGTERM or SIGINT,
 * after accepting every packet it still holds.
 * Build: gcc -O2 -o delayq delayq.c -lnetfilter_queue
 */
#include <errno.h>
#include <arpa/inet.h>
#include <linux/netfilter.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#define RING_SIZE (1u << 17)          /* packets held at once; the kernel queue is capped below it */
#define KERNEL_QUEUE_MAX (1u << 16)
#define SOCKET_BUFFER (64 << 20)

struct held { uint32_t id; uint64_t due_us; };

static struct held ring[RING_SIZE];
static uint32_t head, tail;           /* head: next to release; tail: next free slot */
static uint64_t delay_us;
static uint64_t dropped;              /* packets accepted at once because the ring was full */
static volatile sig_atomic_t stopping;

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int on_packet(struct nfq_q_handle *queue, struct nfgenmsg *msg, struct nfq_data *data, void *unused) {
    (void)msg; (void)unused;
    struct nfqnl_msg_packet_hdr *header = nfq_get_msg_packet_hdr(data);
    uint32_t id = ntohl(header->packet_id);
    if (tail - head >= RING_SIZE) {
        dropped++;
        return nfq_set_verdict(queue, id, NF_ACCEPT, 0, NULL);
    }
    ring[tail % RING_SIZE] = (struct held){id, now_us() + delay_us};
    tail++;
    return 0;
}

static void release_due(struct nfq_q_handle *queue, uint64_t now) {
    while (head != tail && ring[head % RING_SIZE].due_us <= now) {
        nfq_set_verdict(queue, ring[head % RING_SIZE].id, NF_ACCEPT, 0, NULL);
        head++;
    }
}

static int poll_timeout_ms(uint64_t now) {
    if (head == tail)
        return 100;
    uint64_t due = ring[head % RING_SIZE].due_us;
    return due <= now ? 0 : (int)((due - now + 999) / 1000);
}

static void on_signal(int sig) { (void)sig; stopping = 1; }

static struct nfq_q_handle *open_queue(struct nfq_handle *handle, unsigned number) {
    struct nfq_q_handle *queue = nfq_create_queue(handle, (uint16_t)number, &on_packet, NULL);
    if (!queue) {
        perror("nfq_create_queue");
        exit(1);
    }
    if (nfq_set_mode(queue, NFQNL_COPY_META, 0) < 0 || nfq_set_queue_maxlen(queue, KERNEL_QUEUE_MAX) < 0
        || nfq_set_queue_flags(queue, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0) {
        perror("nfq_set_mode/maxlen/flags");
        exit(1);
    }
    int size = SOCKET_BUFFER, on = 1;
    setsockopt(nfq_fd(handle), SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size);
    setsockopt(nfq_fd(handle), SOL_NETLINK, NETLINK_NO_ENOBUFS, &on, sizeof on);
    return queue;
}

static void run(struct nfq_handle *handle, struct nfq_q_handle *queue) {
    static char buffer[1 << 16];
    struct pollfd fd = {nfq_fd(handle), POLLIN, 0};
    while (!stopping) {
        int ready = poll(&fd, 1, poll_timeout_ms(now_us()));
        if (ready < 0 && errno != EINTR) {
            perror("poll");
            break;
        }
        while (ready > 0) {
            ssize_t got = recv(fd.fd, buffer, sizeof buffer, MSG_DONTWAIT);
            if (got <= 0)
                break;
            nfq_handle_packet(handle, buffer, (int)got);
        }
        release_due(queue, now_us());
    }
    release_due(queue, UINT64_MAX);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE_NUMBER DELAY_MICROSECONDS\n", argv[0]);
        return 2;
    }
    delay_us = strtoull(argv[2], NULL, 10);
    struct nfq_handle *handle = nfq_open();
    if (!handle) {
        perror("nfq_open");
        return 1;
    }
    struct nfq_q_handle *queue = open_queue(handle, (unsigned)strtoul(argv[1], NULL, 10));
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    printf("ready\n");
    fflush(stdout);
    run(handle, queue);
    nfq_destroy_queue(queue);
    nfq_close(handle);
    if (dropped)
        fprintf(stderr, "delayq: %llu packet(s) passed undelayed (ring full)\n", (unsigned long long)dropped);
    return 0;
}
